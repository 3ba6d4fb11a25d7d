"""The naive twin: data parallelism with one all-reduce per parameter, as a reference.

    model = NaiveDataParallel(module)      # rank 0's parameters and buffers on every rank
    loss_fn(model(x), y).backward()
    model.sync_grads()                     # every gradient is now the mean over ranks
    optimizer.step()

No buckets, no overlap with backward, no hooks, no flat buffers, no sharding: after backward
the user calls `sync_grads()`, which averages each parameter's gradient with its own blocking
all-reduce. It is slow on purpose and short enough to check by eye, so the tests use it as the
oracle for the real engine (as picotron keeps `DataParallelNaive` beside `DataParallelBucket`).

Gradients that never arrived follow a single process over the whole global batch: a parameter
with no gradient on this rank counts as zero in the mean; a parameter with no gradient on any
rank keeps `.grad = None`, so the optimizer skips it (no weight decay, no momentum). Which is
which is learned from one extra all-reduce of a flags tensor, before the gradients'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["NaiveDataParallel"]


class NaiveDataParallel(torch.nn.Module):
    """Wrap `module`; `sync_grads()` after backward averages gradients over `group`."""

    def __init__(self, module: torch.nn.Module, group=None):
        super().__init__()
        self.module = module
        self.group = group
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed:
            # Rank 0's values everywhere, whatever each rank's seed was.
            src = dist.get_global_rank(group, 0) if group is not None else 0
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t.data, src=src, group=group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Average every trainable parameter's gradient over the ranks of the group."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not self._distributed or not params:
            return
        world = dist.get_world_size(self.group)
        flags = torch.tensor([0.0 if p.grad is None else 1.0 for p in params],
                             device=params[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group)
        for p, got_any in zip(params, flags.tolist()):
            if got_any == 0:
                p.grad = None  # no rank had a gradient: as in one process
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # none here: zero in the mean
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group)
            p.grad.div_(world)
