"""A unit's gradients: reduced over the ranks, and turned into what the step reads (a mixin of
flat.py's `FlatUnit`, which holds the bucket, the owned range and the masters' pieces these
methods use; see [Note: the shard is the truth] there).
"""

from __future__ import annotations

import torch

from ..comm.collectives import Handle
from .vote import FAILED_AT

__all__ = ["UnitGradients"]


class UnitGradients:
    def reduce_grad(self, comm, comm_dtype: torch.dtype | None, shard: bool):
        """Start averaging the unit's bucket over the ranks (asynchronously): all of it, in
        place, where gradients stay full; to the owned shard where they are sharded (by
        reduce-scatter or by all-reduce, as the Comm prefers). The used-flags ride along, or
        go in a collective of their own beside the gradients' (a bucket whose tail is apart,
        or a reduce-scatter). A reduce-scatter writes straight into the owned gradient when
        nothing is accumulated there yet."""
        bucket = self.bucket
        buf = bucket.buffer
        self._sent_compressed = comm_dtype is not None and comm_dtype != buf.dtype
        if self._sent_compressed:
            buf = bucket.copy_for_comm(comm_dtype)
        tag = f"unit[{self.index}]:grads"
        self._received = None
        n = bucket.padded_numel
        if not (shard and (comm.uses_reduce_scatter or bucket.tail_apart)):
            return comm.all_reduce(buf, async_op=True, tag=tag)
        if comm.uses_reduce_scatter:
            if self.grad_shard is None:
                self.grad_shard = torch.empty(self.hi - self.lo, dtype=bucket.dtype,
                                              device=buf.device)
            into = self.reduced is None and buf.dtype == self.grad_shard.dtype
            self._received = self.grad_shard if into else \
                torch.empty(self.hi - self.lo, dtype=buf.dtype, device=buf.device)
            grads = comm.reduce_shard(buf[:n], self._received, tag=tag)
        else:
            grads = comm.all_reduce(buf[:n], async_op=True, tag=tag)
        tail = bucket.tail() if bucket.tail_apart else buf[n:]
        flags = comm.all_reduce(tail, async_op=True, tag=tag + ":flags")
        self.probe = flags if bucket.tail_apart else None
        return Handle(grads.works + flags.works, records=grads.records + flags.records)

    def finish_grad(self, shard: bool) -> None:
        """Turn the reduced bucket into what the step reads, once its collective is done, on
        the device alone: which parameters got a gradient is read by the host later, with
        every unit's, in `take_flags` (see host.py).

        See [Note: gradients that never arrived] in reducer.py: under full gradients a parameter
        still holding an accumulated `.grad` counts as used by itself (its slot is kept, its
        flag set); sharded gradients leave `.grad` None, so the flags of earlier backwards since
        zero_grad() are remembered in `take_flags`.
        """
        bucket = self.bucket
        reduced = bucket.comm_buffer if self._sent_compressed \
            else bucket.buffer
        if shard:
            tail = bucket.tail() if bucket.tail_apart else reduced[bucket.padded_numel:]
            self.tail = tail.clone()  # the bucket's buffer is about to go
            owned = self._received if self._received is not None \
                else reduced[self.lo:self.hi]
            self._received = self.probe = None
            if self.grad_shard is None:
                self.grad_shard = torch.empty(self.hi - self.lo, dtype=bucket.dtype,
                                              device=owned.device)
            # A second backward before zero_grad() accumulates, as in one process.
            if owned is self.grad_shard:
                pass  # reduce-scattered into it
            elif self.reduced is None:
                self.grad_shard.copy_(owned)
            else:
                self.grad_shard.add_(owned)
            self.reduced = self.grad_shard
            for p in self.params:
                p.grad = None
            bucket.free()
            return
        if reduced is not bucket.buffer:
            bucket.buffer.copy_(reduced)  # the mean, into every element: `.grad` is the mean
        # The bucket is kept and the parameters keep their views into it, so a second backward
        # accumulates into it in place (the mean of a sum already equal on every rank plus the
        # new gradients is that sum plus their mean).
        self.tail = bucket.tail()
        self.reduced = bucket.grads()[self.lo:self.hi]

    def take_flags(self, tail: list[float], shard: bool) -> None:
        """The host's part of finishing, given this unit's reduced flags and signal as read."""
        used, self.nonfinite = [f > 0 for f in tail[:-1]], tail[-1] > 0
        self.failed = tail[-1] >= FAILED_AT
        self.tail = None
        if shard:
            if self.used is not None:
                used = [a or b for a, b in zip(self.used, used)]
            self.used = used
            return
        self.used = used
        for i, p in enumerate(self.params):
            p.grad = self.bucket.view(i) if used[i] else None

    def set_piece_grads(self, grad: torch.Tensor | None) -> None:
        """Point every piece's `.grad` at its slice of `grad` (the owned reduced gradient in the
        master dtype), None for parameters that got no gradient on any rank."""
        for piece in self.pieces:
            if grad is None or not self.used[piece.param_index]:
                piece.master.grad = None
            else:
                piece.master.grad = grad[piece.lo:piece.hi].view_as(piece.master)

    def clear_reduced(self) -> None:
        self.reduced = None
        self.used = None
