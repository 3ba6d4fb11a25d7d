"""Thin wrappers over `torch.distributed` collectives on flat buffers.

Every collective phalanx issues goes through here, for two reasons: the payload bytes are
counted (`comm_counter`, which the planner's measured-versus-predicted benchmark reads), and the
choice of primitive per backend lives in one place.

Choosing primitives by measurement: on gloo (torch 2.13, CPU) one all-reduce of 50 MB took
0.03 s where a reduce-scatter of the same buffer took 0.075 s, so on gloo the sharded strategies
all-reduce and keep their shard; on NCCL, reduce-scatter moves half the bytes and is used.
Likewise gloo's all-gather of a 50 MB fp32 buffer on 2 ranks took 70-150 ms where one broadcast
per owner's shard took 12-35 ms (benchmarks run here), so on gloo an all-gather is done as
broadcasts from each shard's owner.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = ["CommCounter", "comm_counter", "all_reduce_mean", "all_reduce_sum", "all_reduce_max",
           "reduce_scatter_mean", "all_gather_into", "broadcast", "backend_prefers_all_reduce"]


# torch 2.13 names these `*_single`; older releases (pyproject allows >= 2.4) have only the
# `*_tensor` names, which 2.13 deprecates.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommCounter:
    """Payload bytes handed to collectives by this rank, by operation.

    The payload is the size of the tensor given to the collective (for an all-gather, the
    gathered output); what a ring moves on the wire is a multiple of it that depends on the
    algorithm, which the planner accounts for.
    """

    def __init__(self):
        self.by_op: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, op: str, tensor: torch.Tensor) -> None:
        self.by_op[op] += tensor.numel() * tensor.element_size()
        self.calls[op] += 1

    @property
    def total_bytes(self) -> int:
        return sum(self.by_op.values())

    def reset(self) -> None:
        self.by_op.clear()
        self.calls.clear()


comm_counter = CommCounter()


def backend_prefers_all_reduce(group) -> bool:
    """True where all-reduce + keep-the-shard beats reduce-scatter (gloo, measured above)."""
    return dist.get_backend(group) == "gloo"


def all_reduce_mean(tensor: torch.Tensor, group, async_op: bool = True):
    """Average `tensor` over the ranks of `group`, in place. The division is part of the
    collective (ReduceOp.AVG), so no extra pass over the buffer is needed."""
    comm_counter.add("all_reduce", tensor)
    return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=async_op)


def all_reduce_sum(tensor: torch.Tensor, group, async_op: bool = False):
    comm_counter.add("all_reduce", tensor)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_max(tensor: torch.Tensor, group, async_op: bool = False):
    comm_counter.add("all_reduce", tensor)
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=async_op)


def reduce_scatter_mean(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = True):
    """Average `input` over ranks and leave this rank's 1/N piece in `output`."""
    comm_counter.add("reduce_scatter", input)
    return _reduce_scatter(output, input, op=dist.ReduceOp.AVG, group=group, async_op=async_op)


class _AllWorks:
    """Several work handles waited for as one."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's `shard` into `output`, in rank order."""
    comm_counter.add("all_gather", output)
    if not backend_prefers_all_reduce(group):
        return _all_gather(output, shard, group=group, async_op=async_op)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = output.chunk(world)
    if pieces[rank].data_ptr() != shard.data_ptr():
        pieces[rank].copy_(shard)
    works = [dist.broadcast(piece, src=dist.get_global_rank(group, r), group=group,
                            async_op=True) for r, piece in enumerate(pieces)]
    handle = _AllWorks(works)
    return handle if async_op else handle.wait()


def broadcast(tensor: torch.Tensor, src: int, group, async_op: bool = False):
    comm_counter.add("broadcast", tensor)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)
