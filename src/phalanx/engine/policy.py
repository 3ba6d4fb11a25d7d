"""A strategy is a row of a residency table: what each rank keeps in full, what it shards.

    strategy  parameters  gradients  optimizer state
    ddp       full        full       full
    zero1     full        full       shard
    zero2     full        shard      shard
    zero3     shard       shard      shard   (alias fsdp; engine/zero3.py)

ZeRO: Rajbhandari et al., 2020, arXiv:1910.02054. The engine (flat_engine.py) reads these fields
and never the strategy's name: `optimizer is SHARD` means each rank owns 1/N of every unit and
its masters and optimizer state cover only that; `grads is SHARD` means a unit's gradients are
reduced to the owned shard and the full bucket is given back during backward, so the model's
`.grad` is None after backward; `grads is FULL` means every `.grad` is the true mean over ranks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Residency", "FULL", "SHARD", "ShardPolicy", "POLICIES"]


class Residency(enum.Enum):
    FULL = "full"
    SHARD = "shard"


FULL, SHARD = Residency.FULL, Residency.SHARD


@dataclass(frozen=True)
class ShardPolicy:
    name: str
    params: Residency
    grads: Residency
    optimizer: Residency


POLICIES = {
    "ddp": ShardPolicy("ddp", params=FULL, grads=FULL, optimizer=FULL),
    "zero1": ShardPolicy("zero1", params=FULL, grads=FULL, optimizer=SHARD),
    "zero2": ShardPolicy("zero2", params=FULL, grads=SHARD, optimizer=SHARD),
    "zero3": ShardPolicy("zero3", params=SHARD, grads=SHARD, optimizer=SHARD),
}
