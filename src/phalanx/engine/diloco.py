"""DiLoCo's outer step: every H inner steps, average the pseudo-gradient and step the weights
that all ranks share (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training
of Language Models", arXiv:2311.08105).

[Note: inner and outer steps]
Under DiLoCo every rank trains its own replica with the user's optimizer (the inner one) and
communicates nothing: the engine behind the model is a ddp engine over a world of one
(model/diloco.py), so `.grad` is this rank's own gradient, `px.no_sync` and accumulation work
as ever, and `px.clip_grad_norm_` clips by this rank's own norm. After every `sync_every`-th
`optimizer.step()` the ranks meet once:

    delta_r   = synced - weights_r          the pseudo-gradient of rank r (a descent
                                            direction written as a gradient: synced minus now,
                                            not now minus synced)
    delta     = mean over ranks of delta_r  one all-reduce, in `comm_dtype` if set
    synced    = outer_sgd(synced, grad=delta)   lr, momentum, Nesterov
    weights_r = synced                      on every rank alike

`synced` is the weights at the last sync, in the masters' dtype (fp32 under bf16 compute), and
the outer optimizer is a `torch.optim.SGD` over those tensors, so its momentum is an ordinary
`momentum_buffer` per parameter. With `sync_every=1`, outer lr 1, no outer momentum and an inner
SGD without momentum, `synced - mean(delta_r)` is the ddp step on the mean gradient.

Buffers (BatchNorm's running statistics) are each rank's own between syncs; at a sync the
floating ones are averaged over the ranks and the others (a step count) take rank 0's values,
so right after a sync every rank holds the same parameters and buffers.
"""

from __future__ import annotations

import torch

__all__ = ["OuterSync"]

# The pseudo-gradient crosses the wire in runs of at most this many bytes (comm dtype), so
# the copy it travels in is bounded whatever the model's size.
RUN_BYTES = 64 * 2**20


class OuterSync:
    """The outer state of a DiLoCo model and its step (see [Note: inner and outer steps])."""

    def __init__(self, config, engine, module: torch.nn.Module, comm):
        self.config = config
        self.comm = comm  # the job's Comm: the outer step is the only communication
        self.engine = engine
        self.params = list(engine.params)
        pieces = engine.master_pieces()
        # What each inner step updates: the parameter itself, or its fp32 master under bf16
        # (the local engine never shards, so each is one whole piece).
        self.masters = [pieces[id(p)][0].master for p in self.params]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        with torch.no_grad():
            self.synced = [torch.nn.Parameter(m.detach().clone(), requires_grad=False)
                           for m in self.masters]
        momentum = float(config.outer_momentum)
        self.outer = torch.optim.SGD(self.synced, lr=config.outer_lr, momentum=momentum,
                                     nesterov=bool(config.nesterov) and momentum > 0)
        self.buffers = [b for b in module.buffers()]
        self.inner_steps = 0  # optimizer steps since the last sync (the same on every rank)
        self.syncs = 0

    def groups(self) -> list:
        """The process groups the outer step issues on (for the step report)."""
        return [self.comm.group] if self.comm.group is not None else []

    def after_step(self) -> None:
        """After every `optimizer.step()`: count it, and sync after the H-th."""
        self.inner_steps += 1
        if self.inner_steps >= self.config.sync_every:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients, step the synced weights, make them every rank's."""
        self.engine.master_pieces()  # takes edits made behind phalanx's back into the masters
        deltas = [s - m for s, m in zip(self.synced, self.masters)]
        self._average(deltas, "diloco:pseudo-gradient")
        for s, d in zip(self.synced, deltas):
            s.grad = d
        self.outer.step()
        for s, m in zip(self.synced, self.masters):
            s.grad = None
            m.copy_(s)
        self.engine.publish_masters()  # bf16: the parameters from the masters (no collective)
        self._sync_buffers()
        self.inner_steps = 0
        self.syncs += 1

    @torch.no_grad()
    def restore(self, weights: list[torch.Tensor] | None, inner_steps: int) -> None:
        """After a load: `synced` holds the loaded weights already; this rank's weights
        become `weights` (None: the synced ones) and the count of inner steps `inner_steps`."""
        for i, m in enumerate(self.masters):
            m.copy_(self.synced[i] if weights is None else weights[i])
        self.engine.publish_masters()
        self.inner_steps = inner_steps

    def _average(self, tensors: list[torch.Tensor], tag: str) -> None:
        """Average `tensors` over the ranks in place, in runs of at most RUN_BYTES, sent in
        `comm_dtype` where one is set."""
        if self.comm.world == 1:
            return
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, members in by_dtype.items():
            wire = self.config.comm_dtype or dtype
            size = torch.empty((), dtype=wire).element_size()
            run, nbytes = [], 0
            for t in members + [None]:
                if run and (t is None or nbytes + t.numel() * size > RUN_BYTES):
                    self._average_run(run, wire, tag)
                    run, nbytes = [], 0
                if t is not None:
                    run.append(t)
                    nbytes += t.numel() * size

    def _average_run(self, run: list[torch.Tensor], wire: torch.dtype, tag: str) -> None:
        flat = torch.cat([t.reshape(-1).to(wire) for t in run])
        self.comm.all_reduce(flat, op="avg", tag=tag)
        offset = 0
        for t in run:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def _sync_buffers(self) -> None:
        if self.comm.world == 1 or not self.buffers:
            return
        floating = [b for b in self.buffers if b.is_floating_point()]
        others = [b for b in self.buffers if not b.is_floating_point()]
        if floating:
            by_dtype: dict = {}
            for b in floating:
                by_dtype.setdefault(b.dtype, []).append(b)
            for members in by_dtype.values():
                self._average_run(members, members[0].dtype, "diloco:buffers")
        for b in others:
            self.comm.broadcast(b, src=0, tag="diloco:buffers")

    # -- what a checkpoint holds (checkpoint/diloco.py) ----------------------------------------
    def momentum_of(self, i: int) -> torch.Tensor | None:
        return self.outer.state.get(self.synced[i], {}).get("momentum_buffer")

    @torch.no_grad()
    def set_momentum(self, i: int, value: torch.Tensor | None) -> None:
        state = self.outer.state[self.synced[i]]
        if value is None:
            state.pop("momentum_buffer", None)
        else:
            state["momentum_buffer"] = value.to(self.synced[i].dtype).clone()
