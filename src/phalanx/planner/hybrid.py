"""shard_size in the plan: what a rank holds and sends when zero1/zero2/zero3 shard within
groups of K ranks and replicate across the N/K groups (engine/hybrid.py).

Memory follows the flat formula with K in place of N (each rank holds 1/K of what is sharded).
Communication splits in two: within the group, the flat layout's collectives over K ranks;
across groups, one all-reduce over the N/K replicas of what each rank holds of the reduced
gradient: its 1/K shard under zero2 and zero3, the whole gradient under zero1 (whose `.grad`
stay the full mean). Those are the payloads the engine's records count (the step report's
`intra_group_bytes` and `inter_group_bytes`, less the used-flags riding with each unit: a few
bytes per parameter tensor). Within a group the link is the intra-node one when the group fits
in a node, and the inter-node link carries the replicas' all-reduce. Which K a plan takes is
decided by the engine's own rules (engine/hybrid.py's `check_shard_size`), as px.prepare's is.
"""

from __future__ import annotations

from ..engine.hybrid import check_shard_size
from ..engine.policy import FULL, ShardPolicy
from .comm import Collective

__all__ = ["plan_shard_size", "across_groups"]


def plan_shard_size(shard_size, world: int, gpus: int, rows) -> int | None:
    """K, or None for the flat layout (None, or K equal to the world): engine/hybrid.py's
    rules, the ones px.prepare applies, for each of `rows` (the strategies planned in groups),
    "node" being the plan's `gpus` per node (the engine reads it from the launcher) and a
    number in text (the command line's) read as one; ValueError otherwise."""
    if isinstance(shard_size, str) and shard_size.strip().lower() == "node":
        shard_size = gpus
    elif isinstance(shard_size, str) and shard_size.strip().isdigit():
        shard_size = int(shard_size)
    size = None
    for row in rows:
        size = check_shard_size(shard_size, row, world)
    return size


def across_groups(policy: ShardPolicy, grad_bytes: int,
                  shard_size: int | None) -> list[Collective]:
    """The collectives that cross groups in one optimizer step (see the module docstring):
    none for a row that shards nothing."""
    if shard_size is None or policy.optimizer is FULL:
        return []
    payload = grad_bytes if policy.grads is FULL else -(-grad_bytes // shard_size)
    return [Collective("all_reduce", payload, "backward")]
