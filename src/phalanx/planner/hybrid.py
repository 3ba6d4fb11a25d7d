"""shard_size in the plan: what a rank holds and sends when zero1/zero2/zero3 shard within
groups of K ranks and replicate across the N/K groups (engine/hybrid.py).

Memory follows the flat formula with K in place of N (each rank holds 1/K of what is sharded).
Communication splits in two: within the group, the flat layout's collectives over K ranks;
across groups, one all-reduce over the N/K replicas of what each rank holds of the reduced
gradient: its 1/K shard under zero2 and zero3, the whole gradient under zero1 (whose `.grad`
stay the full mean). Those are the payloads the engine's records count (the step report's
`intra_group_bytes` and `inter_group_bytes`, less the used-flags riding with each unit: a few
bytes per parameter tensor). Within a group the link is the intra-node one when the group fits
in a node, and the inter-node link carries the replicas' all-reduce.
"""

from __future__ import annotations

from .comm import Collective

__all__ = ["check_plan_shard_size", "across_groups"]


def check_plan_shard_size(shard_size, world: int, gpus: int) -> int | None:
    """K, or None for the flat layout (None, or K equal to the world); ValueError otherwise."""
    if shard_size is None:
        return None
    given = shard_size
    if isinstance(shard_size, str) and shard_size.strip().lower() == "node":
        shard_size = gpus
    elif isinstance(shard_size, str) and shard_size.strip().isdigit():
        shard_size = int(shard_size)
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 2 \
            or world % shard_size:
        raise ValueError(f"shard_size {given!r}: 'node', or a number of ranks of 2 or more "
                         f"that divides the world size {world}")
    return None if shard_size == world else shard_size


def across_groups(strategy: str, grad_bytes: int, shard_size: int | None) -> list[Collective]:
    """The collectives that cross groups in one optimizer step (see the module docstring)."""
    if shard_size is None or strategy == "ddp":
        return []
    payload = grad_bytes if strategy == "zero1" else -(-grad_bytes // shard_size)
    return [Collective("all_reduce", payload, "backward")]
