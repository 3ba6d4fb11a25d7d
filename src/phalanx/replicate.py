"""Replicated data parallelism (`strategy="ddp"`, fp32 parameters).

Every rank keeps the whole model and the whole optimizer. After backward each bucket of
gradients is averaged over ranks with one all-reduce that overlaps the rest of backward (see
reducer.py); the user's optimizer then steps on the model's own parameters, whose `.grad` are
views into the buckets. Nothing about the optimizer changes: its state and state_dict are
exactly those of a single-process run.

After the first backward the buckets are rebuilt in the order gradients actually became ready
on rank 0 (broadcast, so every rank agrees), so each bucket fills as early as possible.
"""

from __future__ import annotations

import torch

from . import collectives as C
from .buckets import GradBucket, assign_buckets
from .reducer import GradReducer

__all__ = ["Replicated"]

_FIRST_BUCKET_MB = 1.0


class Replicated:
    """Bucketed, overlapped gradient all-reduce for a module whose parameters stay as they are."""

    def __init__(self, module: torch.nn.Module, group, bucket_mb: float = 25.0,
                 comm_dtype: torch.dtype | None = None, rebuild_buckets: bool = True):
        self.group = group
        self.comm_dtype = comm_dtype
        self.cap_bytes = int(bucket_mb * 2**20)
        self.params = [p for p in module.parameters() if p.requires_grad]
        buckets = self._make_buckets(list(reversed(self.params)))  # backward runs in reverse
        self.reducer = GradReducer(buckets, self._launch, self._finish,
                                   on_first_order=self._rebuild if rebuild_buckets else None)

    def _make_buckets(self, ordered_params) -> list[GradBucket]:
        first_cap = min(self.cap_bytes, int(_FIRST_BUCKET_MB * 2**20))
        groups = assign_buckets(ordered_params, self.cap_bytes, first_cap)
        return [GradBucket(i, ps, with_flags=True) for i, ps in enumerate(groups)]

    @property
    def buckets(self) -> list[GradBucket]:
        return self.reducer.buckets

    def _compressed(self, bucket: GradBucket) -> bool:
        return self.comm_dtype is not None and self.comm_dtype != bucket.dtype

    def _launch(self, bucket: GradBucket):
        if self._compressed(bucket):
            # Compress what travels; the mean lands back in the fp32 gradients in _finish.
            return C.all_reduce_mean(bucket.copy_for_comm(self.comm_dtype), self.group)
        return C.all_reduce_mean(bucket.buffer, self.group)

    def _finish(self, bucket: GradBucket) -> None:
        if self._compressed(bucket):
            bucket.buffer.copy_(bucket.comm_buffer)
        # See [Note: gradients that never arrived] in reducer.py.
        used_anywhere = (bucket.flags() > 0).tolist()
        for i, (p, used) in enumerate(zip(bucket.params, used_anywhere)):
            p.grad = bucket.view(i) if used else None

    def _rebuild(self, ready_order) -> None:
        """Re-lay the buckets in rank 0's order of gradient readiness (once, after step 1)."""
        index = {p: i for i, p in enumerate(self.params)}
        seen = [index[p] for p in ready_order]
        seen_set = set(seen)
        missing = [i for i in range(len(self.params)) if i not in seen_set]
        order = torch.tensor(seen + missing, dtype=torch.int64, device=self.params[0].device)
        C.broadcast(order, src=0, group=self.group)
        ordered = [self.params[i] for i in order.tolist()]
        current = [p for b in self.buckets for p in b.params]
        if all(a is b for a, b in zip(ordered, current)):
            return
        new_buckets = self._make_buckets(ordered)
        for bucket in new_buckets:
            bucket.allocate()
            for i, p in enumerate(bucket.params):
                if p.grad is not None:
                    bucket.view(i).copy_(p.grad)
                    p.grad = bucket.view(i)
        self.reducer.set_buckets(new_buckets)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        # Gradients are already identical on every rank: the local norm is the global norm.
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type=norm_type)
