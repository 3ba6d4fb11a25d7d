"""Gradient buckets: flat buffers that hold many parameters' gradients.

A bucket owns one flat tensor; each of its parameters' `.grad` is a view into it, so a whole
bucket is communicated with one collective and nothing is copied out afterwards (except under
`comm_dtype`, where the bucket travels as a copy in that dtype and the mean is copied back). A gradient
that autograd makes fresh (after `zero_grad()` set `.grad` to None) is copied in once; later
micro-steps of accumulation add into the view in place. Buckets are filled in the order
gradients become ready in backward, so the first bucket can be on the wire while autograd
still computes the rest.

The layout of a bucket's buffer:

    [ param 0 | ... | padding to a multiple of `pad_to` | used flags | non-finite signal ]

Padding lets a sharded strategy cut the buffer into `world_size` equal shards. The flags (one
element per parameter: 1 where this rank produced a gradient) ride along in the same
all-reduce, so after it every rank knows which parameters got no gradient on any rank, at no
extra collective and no graph traversal. See [Note: gradients that never arrived] in reducer.py.
The flags are written from small tensors kept on the bucket's device, one per pattern of used
parameters seen (in a steady loop, one: all used), so filling them copies nothing from the
host.
"""

from __future__ import annotations

import math

import torch

__all__ = ["GradBucket", "BufferPool"]


class BufferPool:
    """A few flat buffers, each big enough for any bucket, lent to buckets freed every step.

    ZeRO-2 frees each bucket's full gradients once its shard is reduced. Handing the memory
    back to the system and asking for it again next step costs a page fault per 4 KiB page
    (tens of milliseconds per step on CPU), so freed buffers wait here for the next bucket
    instead. The `keep` buffers are made up front, so the memory a run uses does not depend on
    how the collectives happen to be timed; more are made only while more buckets are alive
    (accumulating under no_sync), and at most `keep` are kept.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, keep: int):
        self.numel, self.dtype, self.device, self.keep = numel, dtype, device, keep
        # zeros, not empty: touched once now, so the memory is charged from the start on CPU too
        self.idle = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(keep)]

    def take(self, numel: int) -> torch.Tensor:
        if self.idle:
            return self.idle.pop()[:numel]
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)[:numel]

    def give(self, view: torch.Tensor) -> None:
        if len(self.idle) < self.keep:
            self.idle.append(view._base if view._base is not None else view)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.idle)


class GradBucket:
    """The gradients of a fixed, ordered list of parameters, in one flat buffer."""

    def __init__(self, index: int, params, pad_to: int = 1, dtype: torch.dtype | None = None,
                 pool: BufferPool | None = None):
        self.index = index
        self.pool = pool
        self.params = list(params)
        self.dtype = dtype or self.params[0].dtype
        self.device = self.params[0].device
        self.offsets = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.padded_numel = math.ceil(offset / pad_to) * pad_to
        # The flags, then one slot for the non-finite signal (faults/nonfinite.py).
        self.total_numel = self.padded_numel + len(self.params) + 1
        self._patterns: dict[tuple, torch.Tensor] = {}  # used flags -> the flags on the device
        self.buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] | None = None
        self.comm_buffer: torch.Tensor | None = None

    def allocate(self) -> None:
        """Create the buffer, or borrow it from the bucket's pool.

        Only padding and flags are zeroed for a borrowed buffer: every parameter's slot is
        written (a gradient copied in, or zeros for a missing one) before the bucket is reduced.
        """
        if self.buffer is None:
            if self.pool is None:
                self.buffer = torch.zeros(self.total_numel, dtype=self.dtype, device=self.device)
            else:
                self.buffer = self.pool.take(self.total_numel)
                self.buffer[self.numel:].zero_()
            self._views = [self.buffer[o:o + p.numel()].view_as(p)
                           for o, p in zip(self.offsets, self.params)]

    def copy_for_comm(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer, cast to `dtype` for the wire, in a copy kept between steps (a fresh one
        each step would cost a page fault per 4 KiB on CPU)."""
        if self.comm_buffer is None:
            self.comm_buffer = torch.empty(self.total_numel, dtype=dtype, device=self.device)
        self.comm_buffer.copy_(self.buffer)
        return self.comm_buffer

    def free(self) -> None:
        """Drop the buffer (ZeRO-2 keeps only the reduced shard between steps)."""
        if self.buffer is not None and self.pool is not None:
            self.pool.give(self.buffer)
        self.buffer = None
        self._views = None

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's gradient, as a view into the buffer."""
        return self._views[i]

    def grads(self) -> torch.Tensor:
        """The gradient part of the buffer, padding included, flags excluded."""
        return self.buffer[:self.padded_numel]

    def flags(self) -> torch.Tensor:
        return self.buffer[self.padded_numel:self.padded_numel + len(self.params)]

    def set_flags(self, used: tuple[bool, ...]) -> None:
        """Write the used flags (see the module's docstring: no copy from the host)."""
        values = self._patterns.get(used)
        if values is None:
            values = torch.tensor([1.0 if u else 0.0 for u in used], dtype=self.dtype,
                                  device=self.device)
            if len(self._patterns) < 8:  # a loop whose pattern changes every step: no cache
                self._patterns[used] = values
        self.flags().copy_(values)

    def tail(self) -> torch.Tensor:
        """The flags and the signal, after the reduction: what the host reads once a step."""
        return self.buffer[self.padded_numel:]

    def signal(self) -> torch.Tensor:
        """The one element after the flags: this rank's non-finite flag, summed over ranks."""
        return self.buffer[self.padded_numel + len(self.params):]

    def __repr__(self):
        return (f"GradBucket({self.index}, {len(self.params)} params, {self.numel} elements, "
                f"{self.dtype})")
