"""How phalanx lays out trainable parameters, for the planner: the engine's own function.

The units (gradient buckets, which are also the flat units the sharded strategies cut into
shards) are decided by `phalanx.engine.units`, by the module tree under a size cap; the planner
calls the same function with what it knows of the model (each parameter's size, and the
repeated block it sits in where the model or config says), so its layout cannot drift from the
engine's. The planner needs the sizes for what scales with a unit rather than with the model:
ZeRO-2's pool of bucket buffers, the fp32 gradient that a mixed-precision step makes for one
unit at a time, the optimizer's per-call temporaries and, for zero3, the parameters gathered at
once.
"""

from __future__ import annotations

import math

from ..engine.units import FIRST_UNIT_MIB, unit_caps, unit_numels

__all__ = ["unit_sizes", "FIRST_UNIT_MIB"]


def unit_sizes(shapes, count: int, compute_bytes: int, bucket_mb: float = 25.0,
               blocks=None) -> list[int]:
    """Elements per unit. `shapes` are the trainable parameters' shapes in module order (and
    `blocks` the repeated block of each, None outside blocks or where unknown), or None for a
    bare count, which is then cut into full units."""
    if shapes is None:
        first, cap = unit_caps(bucket_mb, compute_bytes)
        rest = max(0, count - first)
        return [min(count, first)] + [cap] * (rest // cap) + ([rest % cap] if rest % cap else [])
    return unit_numels([math.prod(s) for s in shapes], blocks, compute_bytes, bucket_mb)
