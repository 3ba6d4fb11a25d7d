"""Gradient buckets: flat buffers that hold many parameters' gradients.

A bucket owns one flat tensor; each of its parameters' `.grad` is a view into it, so a whole
bucket is communicated with one collective and nothing is copied out afterwards (except under
`comm_dtype`, where the bucket travels as a copy in that dtype and the mean is copied back). A
gradient that autograd makes fresh (after `zero_grad()` set `.grad` to None) is copied in once;
later micro-steps of accumulation add into the view in place. Buckets are filled in the order
gradients become ready in backward, so the first bucket can be on the wire while autograd still
computes the rest.

The layout of a bucket's buffer:

    [ param 0 | ... | padding to a multiple of `pad_to` | used flags | non-finite signal ]

Padding lets a sharded strategy cut the buffer into `world_size` equal shards. The flags (one
element per parameter: 1 where this rank produced a gradient) ride along in the same
all-reduce, so after it every rank knows which parameters got no gradient on any rank, at no
extra collective and no graph traversal. See [Note: gradients that never arrived] in reducer.py.
The flags are written from small tensors kept on the bucket's device, one per pattern of used
parameters seen (in a steady loop, one: all used), so filling them copies nothing from the
host. The signal carries this rank's non-finite flag (faults/nonfinite.py) and, where its step
raised, its part in the step vote ([Note: the step vote] in vote.py).

[Note: a gradient reduced where autograd made it]
Where gradients are sharded (zero2, zero3) a bucket's full gradients live only until its
reduction is done. A bucket `tail_apart` keeps its flags and signal in a small tensor of their
own, reduced by a collective of its own beside the gradients' (every zero3 bucket, and a zero2
bucket of one parameter that needs no padding: the layout decides, the same on every rank). A
bucket of one parameter needing no padding, tail apart, holds its gradients in the very tensor
autograd made for `.grad` when it arrives fresh (contiguous, in the bucket's dtype, alone in
its storage), so that gradient is neither copied nor doubled, and in a buffer of its own
otherwise; the other buckets borrow from the pool.
"""

from __future__ import annotations

import math

import torch

__all__ = ["aligned_offsets", "aligned_numel", "GradBucket", "BufferPool"]


class BufferPool:
    """A few flat buffers, each big enough for any bucket that borrows, lent to buckets freed
    every step.

    ZeRO-2 and zero3 free each bucket's full gradients once its shard is reduced. Handing the
    memory back to the system and asking for it again next step costs a page fault per 4 KiB
    page (tens of milliseconds per step on CPU), so freed buffers wait here for the next bucket
    instead. The `keep` buffers (as many as the reducer lets be alive at once: one filling, one
    reduced and unfinished) are made up front, each the size of the largest bucket that
    borrows (a bucket reduced where autograd made its gradient never does: see [Note: a
    gradient reduced where autograd made it]), so the memory a run uses does not depend on how
    the collectives happen to be timed; more are made only while more buckets are alive
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


def aligned_offsets(numels: list[int], align: int = 1) -> list[int]:
    """Each of `numels`' start in a flat buffer where every one starts at a multiple of
    `align` (1: end to end)."""
    offsets, offset = [], 0
    for n in numels:
        offset = -(-offset // align) * align
        offsets.append(offset)
        offset += n
    return offsets


def aligned_numel(numels: list[int], align: int, pad_to: int) -> int:
    """What a bucket of `numels` laid out by `aligned_offsets` takes, padded to `pad_to`
    shards that are multiples of `align`."""
    if not numels:
        return 0
    end = aligned_offsets(numels, align)[-1] + numels[-1]
    return math.ceil(end / (pad_to * align)) * pad_to * align


class GradBucket:
    """The gradients of a fixed, ordered list of parameters, in one flat buffer."""

    def __init__(self, index: int, params, pad_to: int = 1, dtype: torch.dtype | None = None,
                 pool: BufferPool | None = None, tail_apart: bool = False, align: int = 1):
        self.index = index
        self.params = list(params)
        self.dtype = dtype or self.params[0].dtype
        self.device = self.params[0].device
        # `align`: each parameter starts at a multiple of it, and each of the `pad_to` shards
        # is a multiple of it, so a shard boundary falls on a block boundary of every
        # parameter it cuts ([Note: state in blocks] in optim.py); the gaps hold zeros
        self.offsets = aligned_offsets([p.numel() for p in self.params], align)
        offset = self.offsets[-1] + self.params[-1].numel() if self.params else 0
        self.gaps = [(end, start) for end, start in
                     zip([o + p.numel() for o, p in zip(self.offsets, self.params)],
                         self.offsets[1:]) if start > end]
        self.numel = offset
        self.padded_numel = math.ceil(offset / (pad_to * align)) * pad_to * align
        # The flags, then one slot for the non-finite signal (faults/nonfinite.py).
        self.total_numel = self.padded_numel + len(self.params) + 1
        # See [Note: a gradient reduced where autograd made it]: the flags and the signal in a
        # tensor of their own, the buffer the gradients alone (never the pool's)
        self.tail_apart = tail_apart
        self.alone = tail_apart and len(self.params) == 1 and self.padded_numel == offset
        self.pool = None if self.alone else pool
        self._tail: torch.Tensor | None = None
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
            if self.tail_apart:
                self._make_tail()
            if self.alone:
                self.buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            elif self.pool is None:
                self.buffer = torch.zeros(self.total_numel, dtype=self.dtype, device=self.device)
            else:
                self.buffer = self.pool.take(self.total_numel)
                self.buffer[self.numel:].zero_()
                for a, b in self.gaps:
                    self.buffer[a:b].zero_()
            self._views = [self.buffer[o:o + p.numel()].view_as(p)
                           for o, p in zip(self.offsets, self.params)]

    def takes(self, grad: torch.Tensor) -> bool:
        """Whether `grad`, autograd's gradient of the bucket's one parameter, can be the buffer
        itself (see [Note: a gradient reduced where autograd made it])."""
        return (self.alone and self.buffer is None and grad.dtype == self.dtype
                and grad.device == self.device and grad.layout == torch.strided
                and not grad.requires_grad and grad.is_contiguous()
                and grad.storage_offset() == 0
                and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size())

    def take(self, grad: torch.Tensor) -> None:
        """Make `grad` the buffer (`takes(grad)` said it can be): no copy, no second buffer."""
        self._make_tail()
        self.buffer = grad.view(-1)
        self._views = [grad]

    def _make_tail(self) -> None:
        if self._tail is None:
            self._tail = torch.zeros(len(self.params) + 1, dtype=self.dtype, device=self.device)

    def copy_for_comm(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer, cast to `dtype` for the wire, in a copy kept between steps (a fresh one
        each step would cost a page fault per 4 KiB on CPU)."""
        if self.comm_buffer is None:
            self.comm_buffer = torch.empty(self.buffer.numel(), dtype=dtype, device=self.device)
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
        return self.tail()[:len(self.params)]

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
        return self._tail if self.tail_apart else self.buffer[self.padded_numel:]

    def signal(self) -> torch.Tensor:
        """The one element after the flags: this rank's non-finite flag, summed over ranks."""
        return self.tail()[len(self.params):]

    def __repr__(self):
        return (f"GradBucket({self.index}, {len(self.params)} params, {self.numel} elements, "
                f"{self.dtype})")
