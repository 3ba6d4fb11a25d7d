"""Hybrid sharding: state sharded within groups of `shard_size` ranks, replicated across them.

[Note: two groups per rank]
With N ranks and shard_size K (K divides N, 1 < K < N), rank r belongs to two groups: its
*shard group*, the K consecutive ranks r - r % K ... r - r % K + K - 1, and its *replica
group*, the N/K ranks at its position r % K in every shard group (groups.partition). The
engine shards over the shard group exactly as it shards over the whole world without
`shard_size`: units padded to K, masters, optimizer state and zero3's gathers over K ranks,
the shard service (remote.py) and `px.optimizer_state_dict` within the group. Nothing of that
knows there are replicas. What crosses groups is the gradient alone: once a unit's gradient is
reduced within the group (the group's mean, into the owned shard under zero2 and zero3, into
the whole bucket under zero1, whose `.grad` are the mean), the replica group averages that
shard (or bucket) and the unit's used-flags and signal with it, so every replica of a shard
then holds the mean over all N ranks. The mean of K-rank means of equal size is the N-rank
mean, so one process's arithmetic holds, within round-off (float64 parity: tests/test_hybrid.py).
So zero3's gathers and zero1/zero2's all-gather of updated parameters never cross groups, and
across groups each rank sends 1/K of the gradient (zero2, zero3) or all of it (zero1).

[Note: the replica average is waited for at the end of backward]
Each unit's replica average is issued, asynchronously, when its group reduction has finished
(in launch order, the same on every rank: flat_engine's `_reorder` hands global rank 0's order
to every group), and all are waited for at the end of backward, before the flags are read.
Waiting for each one as it is issued would block a rank's backward on another group while its
own group may be waiting for it in a zero3 gather: two groups can each hold a rank the other
needs (measured to be possible by ordering alone: a rank finishes a unit before or after a
gather depending on when the group reduction completes).

[Note: the replica average in comm_dtype]
With `comm_dtype` (bf16/fp16) the group reduction sends a narrow copy of the bucket and copies
the mean back (flat.py's reduce_grad); the replica average does the same with what it averages:
the shard (or zero1's bucket) is cast, all-reduced in that dtype and copied back at full width
when waited for, so the bytes across groups shrink as those within do (bf16 against float64: a
quarter). The used-flags and signal travel as they came out of the group's reduction: in
comm_dtype, in zero1's bucket or beside the shard (a mean of 0s and 1s over K ranks stays above
0 when rounded, an inf stays inf). The group's mean came out of a sum in comm_dtype, so its cast
is exact; the replicas' sum rounds once more than the flat layout's one sum, within the tolerance
tests/test_hybrid_precision.py states.

What the replicas hold is equal by construction, so gradient clipping and fp16's overflow check
agree within the shard group only (each shard counted once), and a checkpoint is written by the
first replica group and read by every one (checkpoint/state.py).
"""

from __future__ import annotations

import os

import torch

from ..comm import groups
from ..comm.collectives import Comm
from .policy import FULL, ShardPolicy

__all__ = ["check_shard_size", "shard_size_in", "shard_groups", "Replicas", "REPLICAS"]

REPLICAS = "hybrid:replicas"   # the replica group's name in records and step reports
SHARDS = "hybrid:shards"


def check_shard_size(shard_size, policy: ShardPolicy, world: int,
                     staleness: int = 0) -> int | None:
    """The shard group's size, or None for the whole world (the flat layout); a ValueError
    naming the cause and the fix otherwise, raised on every rank alike before any collective
    (it depends on the arguments, the world size and the launcher's LOCAL_WORLD_SIZE)."""
    if shard_size is None:
        return None
    given = shard_size
    if shard_size == "node":
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None or not local.isdigit():
            raise ValueError("shard_size='node' reads the ranks of one node from LOCAL_WORLD_SIZE, "
                             "which the launcher did not set; start with phalanx run or "
                             "torchrun, or give shard_size as a number of ranks")
        shard_size = int(local)
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size={given!r}: a number of ranks (2 or more, dividing the "
                         f"world size), 'node', or None (shard over all {world} ranks)")
    if shard_size == world:
        return None
    if policy.optimizer is FULL:
        raise ValueError(f"shard_size={given!r} with strategy={policy.name!r}: {policy.name} "
                         "shards nothing; use strategy='zero1', 'zero2' or 'zero3' to shard "
                         "within groups of ranks")
    if shard_size == 1:
        raise ValueError("shard_size=1 shards nothing (every rank a group of its own): use "
                         "strategy='ddp', or a shard_size of 2 or more")
    if world % shard_size:
        raise ValueError(f"shard_size={given!r} (={shard_size}) does not divide the world size "
                         f"{world}: the ranks must form equal groups; pick a divisor of {world}")
    if staleness:
        raise ValueError("staleness=1 is not available with shard_size: the delayed average "
                         "runs over the whole world; use one or the other")
    return shard_size


def shard_size_in(shard_size: int | None, world: int) -> int | None:
    """[Note: shard groups after a loss]
    `shard_size` was checked against the world `px.prepare` saw: it divides it. Under `phalanx
    run --on-failure continue` the world then shrinks when a rank is lost and grows back when
    its replacement joins, and the engine is built again for each world (model/relayout.py,
    loading the newest checkpoint: continuing/steps.py). Groups of `shard_size` do not divide
    every world, so a world they do not divide is laid out in groups of the smallest size at
    least `shard_size` that divides it (all of its ranks at worst: no groups): no rank holds
    more of the state than it did, and the layout comes back to `shard_size` when the world
    does. (Groups then cross nodes until the replacement joins.)"""
    if shard_size is None or shard_size >= world:
        return None
    size = next(d for d in range(shard_size, world + 1) if world % d == 0)
    return None if size == world else size


def shard_groups(comm: Comm, shard_size: int | None) -> tuple[Comm, "Replicas | None"]:
    """The Comm the engine shards over and the replicas' averaging (None: no groups,
    `comm` itself). Makes the groups: a collective of every rank of `comm`."""
    if shard_size is None or comm.group is None:
        return comm, None
    shards, replicas = groups.partition(comm.group, shard_size)
    shard_comm = Comm(shards, name=SHARDS, steps=comm.steps, device=comm.device)
    replica_comm = Comm(replicas, name=REPLICAS, steps=comm.steps, device=comm.device)
    for c in (shard_comm, replica_comm):
        c.uses_reduce_scatter = comm.uses_reduce_scatter
        c.gathers_by_broadcast = comm.gathers_by_broadcast
    return shard_comm, Replicas(replica_comm, comm)


class Replicas:
    """The averaging of each reduced unit over its replicas (see the module's Notes)."""

    def __init__(self, comm: Comm, job: Comm):
        self.comm = comm
        self.job = job   # the job's Comm: what spans groups (checkpoints, the step report)
        self.pending: list = []   # (work, full-width tensor or None, what was sent)
        self._wires: dict[int, torch.Tensor] = {}

    def average(self, unit, shard: bool, comm_dtype: torch.dtype | None = None) -> None:
        """Issue the average of `unit`'s reduced gradient (its owned shard where gradients are
        sharded, else the whole bucket) and its flags over the replicas, once `finish_grad`
        has made them. With `comm_dtype` the gradient travels in that dtype, as it did within
        the group (see [Note: the replica average in comm_dtype])."""
        tag = f"unit[{unit.index}]:replicas"
        full = unit.grad_shard if shard else unit.bucket.buffer
        wire = full
        if comm_dtype is not None and comm_dtype != full.dtype:
            wire = self._wire(unit, full, comm_dtype, shard)
        work = self.comm.all_reduce(wire, async_op=True, tag=tag)
        self.pending.append((work, full if wire is not full else None, wire))
        if shard:
            self.pending.append((self.comm.all_reduce(unit.tail, async_op=True,
                                                      tag=tag + ":flags"), None, None))

    def _wire(self, unit, full: torch.Tensor, dtype: torch.dtype, shard: bool) -> torch.Tensor:
        """`full` cast to `dtype` in a copy kept between steps: the bucket's own wire copy
        where the whole bucket travels (zero1), one per unit's shard otherwise."""
        if not shard:
            return unit.bucket.copy_for_comm(dtype)
        wire = self._wires.get(unit.index)
        if wire is None or wire.dtype != dtype or wire.numel() != full.numel():
            wire = self._wires[unit.index] = torch.empty(full.numel(), dtype=dtype,
                                                         device=full.device)
        return wire.copy_(full)

    def wait(self) -> None:
        """Every average issued in this backward is done, and copied back to full width where
        it travelled narrower."""
        pending, self.pending = self.pending, []
        for work, full, wire in pending:
            work.wait()
            if full is not None:
                full.copy_(wire)

    def order(self, order: torch.Tensor) -> None:
        """Give every rank global rank 0's launch order, once each group's rank 0 has given its
        group its own (flat_engine's `_reorder`): the ranks of the first group then hold rank
        0's, and each broadcasts it over its replica group."""
        self.comm.broadcast(order, src=0, tag="launch order")
