"""How phalanx lays out trainable parameters: gradient buckets, which are also the flat units
that the sharded strategies cut into shards (sharding.py, buckets.py).

Parameters are taken in reverse order (the order backward produces their gradients) and packed
greedily into buckets of at most `bucket_mb` MiB in the compute dtype; the first bucket is capped
at 1 MiB so that its collective starts early, and a parameter larger than the cap gets a bucket
of its own. The planner needs the sizes for what scales with a unit rather than with the model:
ZeRO-2's pool of bucket buffers, the fp32 gradient that a mixed-precision step makes for one
unit at a time, the optimizer's per-tensor temporaries and, for zero3, the parameters gathered
at once.
"""

from __future__ import annotations

import math

__all__ = ["unit_sizes"]

FIRST_BUCKET_MIB = 1.0


def unit_sizes(shapes, count: int, compute_bytes: int, bucket_mb: float = 25.0) -> list[int]:
    """Elements per unit. `shapes` are the trainable parameters' shapes in module order, or None
    for a bare count, which is then cut into full buckets."""
    cap = max(1, int(bucket_mb * 2**20) // compute_bytes)
    first_cap = min(cap, max(1, int(FIRST_BUCKET_MIB * 2**20) // compute_bytes))
    sizes = [math.prod(s) for s in reversed(shapes)] if shapes is not None else None
    if sizes is None:
        rest = max(0, count - first_cap)
        return [min(count, first_cap)] + [cap] * (rest // cap) + ([rest % cap] if rest % cap else [])
    units: list[int] = []
    current, limit = 0, first_cap
    for size in sizes:
        if current and current + size > limit:
            units.append(current)
            current, limit = 0, cap
        current += size
    if current:
        units.append(current)
    return units or [0]
