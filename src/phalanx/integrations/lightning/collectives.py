"""The collectives Lightning asks a strategy for, over the job's process group.

`self.log(..., sync_dist=True)` reduces each logged value, `self.all_gather` gathers, and the
Trainer broadcasts its decisions (a checkpoint's path, whether to stop) and holds barriers.
Under `PhalanxStrategy` these are torch.distributed's calls on the group `px.init()` joined, as
DDPStrategy makes them (so a logged mean is the same number under both); the barrier is
`px.barrier()`, and a gather without gradients `px.gather`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import phalanx as px

__all__ = ["Collectives", "broadcast_module"]


class Collectives:
    """The collectives of Lightning's strategy APIs (Trainer's and Fabric's names both)."""

    def barrier(self, name: str | None = None) -> None:
        if _distributed():
            px.barrier()

    def broadcast(self, obj, src: int = 0):
        if not _distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """`self.log(..., sync_dist=True)` and Lightning's own reductions: sum, mean, max, min
        over the ranks, as DDPStrategy computes them."""
        if not isinstance(tensor, torch.Tensor) or not _distributed():
            return tensor
        op = str(getattr(reduce_op, "name", reduce_op) or "sum").lower()
        op = {"mean": "avg"}.get(op, op)
        if op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"PhalanxStrategy reduces by 'sum', 'mean', 'max' or 'min', not "
                             f"{reduce_op!r}")
        wire = {"avg": dist.ReduceOp.SUM}.get(op, getattr(dist.ReduceOp, op.upper()))
        dist.all_reduce(tensor, op=wire, group=group)
        if op == "avg":
            tensor = tensor.copy_(tensor / dist.get_world_size(group)) \
                if tensor.is_floating_point() else tensor / dist.get_world_size(group)
        return tensor

    all_reduce = reduce  # Fabric's name

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        if not _distributed():
            return tensor.unsqueeze(0)
        if sync_grads:  # differentiable: each rank's gradient flows back to its own tensor
            from torch.distributed.nn.functional import all_gather
            return torch.stack(all_gather(tensor.contiguous(), group=group or dist.group.WORLD))
        return torch.stack(px.gather(tensor.contiguous(), group=group))

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        votes = self.reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@torch.no_grad()
def broadcast_module(module) -> None:
    """Every rank gets rank 0's parameters and buffers (a model evaluated unprepared)."""
    if _distributed():
        for tensor in module.state_dict().values():
            if isinstance(tensor, torch.Tensor):
                dist.broadcast(tensor, 0)
