"""A strategy is a row of a residency table: what each rank keeps in full, what it shards, and
where (on the device, or in host memory).

    strategy  parameters  gradients  optimizer state
    ddp       full        full       full
    zero1     full        full       shard
    zero2     full        shard      shard
    zero3     shard       shard      shard   (alias fsdp; engine/zero3.py)

`px.prepare(..., offload=)` moves a row's places (engine/offload.py): "optimizer" puts the
masters and the optimizer state (`masters`) in host memory, stepped there; "params", under
zero3 only, the parameter shards between uses (`shards`) too. Gradients stay on the device.

ZeRO: Rajbhandari et al., 2020, arXiv:1910.02054. The engine (flat_engine.py) reads these fields
and never the strategy's name: `optimizer is SHARD` means each rank owns 1/N of every unit and
its masters and optimizer state cover only that; `grads is SHARD` means a unit's gradients are
reduced to the owned shard and the full bucket is given back during backward, so the model's
`.grad` is None after backward; `grads is FULL` means every `.grad` is the true mean over ranks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

__all__ = ["Residency", "FULL", "SHARD", "Place", "DEVICE", "HOST", "ShardPolicy", "POLICIES",
           "placed"]


class Residency(enum.Enum):
    FULL = "full"
    SHARD = "shard"


FULL, SHARD = Residency.FULL, Residency.SHARD


class Place(enum.Enum):
    DEVICE = "device"
    HOST = "host"


DEVICE, HOST = Place.DEVICE, Place.HOST


@dataclass(frozen=True)
class ShardPolicy:
    name: str
    params: Residency
    grads: Residency
    optimizer: Residency
    masters: Place = DEVICE  # the masters and the optimizer state
    shards: Place = DEVICE   # zero3's parameter shards between uses

    # What the row splits over a world of `world` ranks: nothing in a world of one, where the
    # row's SHARD holds everything. The engine and each of its units read the row through
    # these, so the decoding lives here once.
    def shards_optimizer(self, world: int) -> bool:
        """The optimizer state (and the masters) split 1/N per rank."""
        return self.optimizer is SHARD and world > 1

    def shards_grads(self, world: int) -> bool:
        """Gradients reduced to the owned shard, the full bucket given back in backward."""
        return self.grads is SHARD and world > 1

    def reshards(self, world: int) -> bool:
        """zero3: parameters exist only while their unit computes (zero3.py)."""
        return self.params is SHARD and world > 1

    def shards_on_host(self, world: int) -> bool:
        """zero3 under offload="params": its parameter shards in host memory between uses."""
        return self.shards is HOST and self.reshards(world)


POLICIES = {
    "ddp": ShardPolicy("ddp", params=FULL, grads=FULL, optimizer=FULL),
    "zero1": ShardPolicy("zero1", params=FULL, grads=FULL, optimizer=SHARD),
    "zero2": ShardPolicy("zero2", params=FULL, grads=SHARD, optimizer=SHARD),
    "zero3": ShardPolicy("zero3", params=SHARD, grads=SHARD, optimizer=SHARD),
}


def placed(policy: ShardPolicy, offload: str | None) -> ShardPolicy:
    """`policy` with the places `offload` asks for (None: all on the device); the combination
    was checked by model/spec.py's COMBINATIONS."""
    if offload is None:
        return policy
    return replace(policy, masters=HOST, shards=HOST if offload == "params" else DEVICE)
