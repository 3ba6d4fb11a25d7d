"""Buffers kept as torch DDP keeps them: rank 0's, broadcast once per synchronised step.

[Note: buffers as torch DDP keeps them]
A buffer (BatchNorm's running mean and variance, its batch count) changes in the forward, on
each rank from its own batch, so the ranks' copies drift apart. torch DDP, with
`broadcast_buffers=True` (its default), broadcasts rank 0's buffers before a forward whose
previous forward ran with gradients and synchronisation (`require_forward_param_sync`): before
every training forward, and before the first forward of an evaluation after training; not
after a forward under `no_sync` or `torch.no_grad()`. So every rank trains with, and evaluates
with, rank 0's statistics as rank 0's last training forward left them.

Here the same values are broadcast at the end of each backward that synchronises gradients
(the engine's end of backward, engine/flat_engine.py): the buffers are then rank 0's as its
forward of that step left them, which is what DDP broadcasts before the next forward. The
forwards that follow see the same values as under DDP, in training, under accumulation
(`no_sync` micro-steps communicate nothing, and DDP's forward after one broadcasts nothing),
and in evaluation, with one difference that matters: an evaluation makes no collective. A rank
that evaluates alone under `torch.no_grad()` (one rank alone, docs/guides/one-rank-alone.md)
waits for nobody, where DDP's first evaluation forward would wait for every rank. (A forward
with gradients that no backward follows leaves its buffers unbroadcast until the next backward
that synchronises; in evaluation mode BatchNorm does not change them.)

The end of backward is also where a rank whose step raised makes the step's collectives after
all ([Note: the step vote] in engine/vote.py), so the broadcast stays in the same order on every
rank; in a step lost under continue mode nothing is broadcast (continuing/).
"""

from __future__ import annotations

from .consistency import broadcast_tensors

__all__ = ["BufferBroadcast"]


class BufferBroadcast:
    """Rank 0's buffers to every rank of `comm` (the job's), at the end of each backward that
    synchronises (see the Note)."""

    def __init__(self, buffers, comm):
        self.buffers = list(buffers)
        self.comm = comm

    def after_backward(self) -> None:
        broadcast_tensors(self.buffers, self.comm, tag="buffers")

    @classmethod
    def of(cls, module, comm) -> "BufferBroadcast | None":
        """The broadcast of `module`'s buffers over `comm`; None where there is nothing to keep
        equal (no buffers, a world of one)."""
        buffers = [b for b in module.buffers()]
        return cls(buffers, comm) if buffers and comm.world > 1 else None
