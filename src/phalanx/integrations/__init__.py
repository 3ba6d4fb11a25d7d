"""Adapters that run phalanx under the tools users already train with.

Each adapter lives in its own subpackage, needs its own optional extra, and uses only phalanx's
public API (px.init, px.prepare, px.save/px.load, px.no_sync, px.clip_grad_norm_...): nothing
below `phalanx.integrations` is imported by `import phalanx`, and nothing in the engine knows
any of them.

- `phalanx.integrations.lightning`: `PhalanxStrategy`, a strategy for `lightning.Trainer` and
  `lightning.Fabric` (`pip install 'phalanx[lightning]'`).

Ray Train, Kubernetes (Kubeflow's PyTorchJob) and Hugging Face's Trainer need no adapter: see
docs/guides/launching.md and docs/guides/integrations/.
"""
