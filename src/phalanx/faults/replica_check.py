"""The replica check: every K optimizer steps, are the ranks' parameters still the same?

Data parallelism keeps the replicas identical only if every rank applies the same update to
the same values. A rank whose parameters were changed behind phalanx's back (an edit on one
rank, a non-deterministic custom op, memory corruption) trains on silently. With
`px.prepare(..., check_replicas_every=K)` every K-th `optimizer.step()` each rank takes a
checksum of its parameters, the ranks compare them in one small all-gather, and a difference
raises on every rank, naming the ranks that differ from the others and the step.

The checksum is exact: the sum, in int64, of each parameter's bits read as integers, so any
change to any element shows (unless changes cancel exactly), and ranks that hold bitwise
equal parameters, as data parallelism makes them, agree. It costs one read of the parameters
every K steps.
"""

from __future__ import annotations

from collections import Counter

import torch

__all__ = ["ReplicaCheck", "ReplicasDiffer"]

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


class ReplicasDiffer(RuntimeError):
    """The ranks' parameters are no longer the same."""


@torch.no_grad()
def checksum(params) -> list[int]:
    """One exact integer per parameter: the sum of its elements' bit patterns."""
    out = []
    for p in params:
        bits = p.detach().reshape(-1).view(_INT_VIEW[p.element_size()])
        out.append(int(bits.sum(dtype=torch.int64)))
    return out


class ReplicaCheck:
    def __init__(self, params, names: list[str], comm, every: int):
        self.params = list(params)
        self.names = names
        self.comm = comm
        self.every = every
        self.steps = 0

    def after_step(self) -> None:
        self.steps += 1
        if self.comm.group is None or self.steps % self.every:
            return
        mine = checksum(self.params)
        every_rank = self.comm.all_gather_object(mine, tag="replica check")
        if all(sums == every_rank[0] for sums in every_rank):
            return
        votes = Counter(tuple(sums) for sums in every_rank)
        (majority, count), = votes.most_common(1)
        if count * 2 <= len(every_rank):  # no majority: compare with rank 0
            majority = tuple(every_rank[0])
        drifted = [r for r, sums in enumerate(every_rank) if tuple(sums) != majority]
        first = next(i for i, (a, b) in enumerate(zip(every_rank[drifted[0]], majority))
                     if a != b)
        raise ReplicasDiffer(
            f"the replicas differ at optimizer step {self.steps}: rank(s) "
            f"{', '.join(map(str, drifted))} hold other parameters than the rest (first: "
            f"{self.names[first]!r}). Something changed them on those ranks only (an edit "
            "made on one rank, a non-deterministic op, a fault); restart from the last "
            "checkpoint")
