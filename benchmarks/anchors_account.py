"""Where the megabytes are, for benchmarks/anchors.py --account: at every hook of a training
step, the resident set beside the storages it can name, by what holds them.

Hooks: each module's forward (before and after), each trainable parameter's gradient as it
arrives (before phalanx's own hook: autograd's fresh gradient still in hand, the unit still
gathered) and once it is accumulated (after phalanx's hook: the gradient out, the unit freed,
the next one's gather deferred until then issued), and the optimizer step (before it, after
it). Each sample takes VmRSS (above the baseline) and walks what the engine and the optimizer
hold, counting each storage once, by the first category that holds it:

  masters       the owned master slices (zero1/2/3), or the parameters themselves (ddp)
  params full   the full compute-dtype buffers the parameters are views of (zero1/zero2 keep
                them; zero3's gathered units)
  grad shards   the reduced owned gradient of each unit (zero2/zero3)
  opt state     the optimizer's moments and step counts
  grads full    full-gradient buffers: kept buckets (ddp, zero1), autograd's gradients being
                reduced where they were made, borrowed pool buffers in use
  pool idle     the pool's buffers waiting for the next bucket
  fresh grad    a gradient autograd has just made, not yet in a bucket
  small         flags, tails, signals and other tensors under 1 MiB
  untracked     the resident set minus all of the above: what no tensor named here holds
                (the process's fixed costs, glibc's kept blocks, the optimizer's temporaries
                inside its step, activations)

The report is the largest sample, each category in MiB, and the largest sample of each phase.
Only phalanx's configurations are walked (the competitors' states are inside torch); for them
the report holds the resident set at each hook alone.
"""

from __future__ import annotations

import re

import torch

MB = 2**20
CATEGORIES = ("masters", "params full", "grad shards", "opt state", "grads full", "pool idle",
              "fresh grad", "small")


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) * 1024


def _storage(t):
    if t is None or not torch.is_tensor(t):
        return None
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes()) if s.nbytes() else None


class Accountant:
    def __init__(self, model, optimizer, config: str, baseline: int):
        self.model, self.optimizer, self.baseline = model, optimizer, baseline
        self.engine = getattr(model, "_engine", None)
        self.phase = "build"
        self.samples: list[tuple[int, str, dict]] = []
        self.fresh = None  # the gradient in hand at a pre-accumulate hook
        module = getattr(model, "module", model)
        for name, sub in module.named_modules():
            sub.register_forward_pre_hook(lambda m, a, n=name: self.sample(f"fwd {n} before"))
            sub.register_forward_hook(lambda m, a, o, n=name: self.sample(f"fwd {n} after"))
        for name, p in module.named_parameters():
            if p.requires_grad:
                p.register_hook(lambda g, n=name: self._fresh(g, n))
                p.register_post_accumulate_grad_hook(lambda q, n=name: self.sample(f"acc {n}"))
        optimizer.register_step_pre_hook(lambda *a: self.sample("step before"))
        optimizer.register_step_post_hook(lambda *a: self.sample("step after"))

    def _fresh(self, grad, name):
        self.fresh = grad
        self.sample(f"grad {name} arrives")
        self.fresh = None

    def sample(self, label: str) -> None:
        rss = _rss() - self.baseline
        counts = self.count() if self.engine is not None else {}
        if counts:
            counts["untracked"] = rss - sum(counts.values())
        self.samples.append((rss, label, counts))

    def count(self) -> dict:
        seen, out = set(), dict.fromkeys(CATEGORIES, 0)

        def add(category, t):
            key = _storage(t)
            if key is None or key[0] in seen:
                return
            seen.add(key[0])
            out["small" if key[1] < MB else category] += key[1]

        engine = self.engine
        for unit in engine.units:  # first: zero1/zero2's fp32 masters are views into them
            if unit.flat is not None and unit.gathered:
                add("params full", unit.flat)
        for unit in engine.units:
            add("masters", unit.master)
            for piece in unit.pieces:
                add("masters", piece.master)
            add("grad shards", unit.grad_shard)
        for state in self.optimizer.state.values():
            for v in state.values():
                add("opt state", v)
        for unit in engine.units:
            b = unit.bucket
            add("grads full", b.buffer)
            add("small", b.comm_buffer)
            add("small", unit.tail)
        if engine.pool is not None:
            for t in engine.pool.tensors():
                add("pool idle", t)
        for p in engine.params:
            add("fresh grad", p.grad)
            if p.untyped_storage().nbytes():
                add("params full", p)
        add("fresh grad", self.fresh)
        return out

    def report(self) -> str:
        if not self.samples:
            return "no samples"
        lines = []
        top = max(self.samples, key=lambda s: s[0])
        lines.append(self._line("largest", top))
        by_kind = {}
        for s in self.samples:  # by hook, and for gradients by the parameter's own name
            words = s[1].split()
            kind = words[0] + (f" *.{words[1].rsplit('.', 1)[-1]}"
                               if words[0] in ("grad", "acc") else "")
            if kind not in by_kind or s[0] > by_kind[kind][0]:
                by_kind[kind] = s
        for kind, s in by_kind.items():
            if s is not top:
                lines.append(self._line(f"largest at '{kind}'", s))
        return "\n  ".join(lines)

    @staticmethod
    def _line(what, sample) -> str:
        rss, label, counts = sample
        parts = ", ".join(f"{k} {v / MB:.1f}" for k, v in counts.items() if v)
        return f"{what}: {rss / MB:.1f} MiB at {label!r}" + (f" = {parts}" if parts else "")
