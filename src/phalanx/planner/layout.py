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

__all__ = ["unit_sizes", "zero3_gathering", "FIRST_UNIT_MIB"]


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


def zero3_gathering(desc, compute_bytes: int, bucket_mb: float = 25.0) -> tuple[int, int]:
    """zero3: (elements gathered at once at most, elements kept gathered from forward to
    backward). Units are gathered together by root (engine/gather.py): the units rooted at the
    model itself, and the root the forward ends with, stay gathered into backward; of the other
    roots, the one computing and the one prefetched (prefetch=1) are gathered at once. From a
    module the roots are the engine's own, the last registered taken as the last to run; from
    a config, each repeated block is a root and the rest is left out (a model-level embedding
    tied to the head would add its size)."""
    if desc.module is not None:
        from ..engine.gather import unit_roots
        from ..engine.units import module_units

        params = [p for p in desc.module.parameters() if p.requires_grad]
        if not params:
            return 0, 0
        runs = module_units(desc.module, params, compute_bytes, bucket_mb, desc.block_classes)
        sizes: dict[str, int] = {}  # in backward order: the forward's last root first
        for run, root in zip(runs, unit_roots(desc.module, runs, desc.block_classes)):
            sizes[root] = sizes.get(root, 0) + sum(p.numel() for p in run)
        model_rooted = sizes.pop("", 0)
        last = next(iter(sizes.values()), 0)
    else:
        model_rooted, sizes = 0, {}
        shapes, blocks = desc.trainable_shapes, desc.trainable_blocks
        if shapes is not None and blocks is not None:
            for shape, block in reversed(list(zip(shapes, blocks))):
                if block is not None:
                    sizes[block] = sizes.get(block, 0) + math.prod(shape)
        if not sizes:  # a bare count: two of the largest unit
            return 2 * max(unit_sizes(shapes, desc.trainable_params, compute_bytes, bucket_mb,
                                      blocks)), 0
        last = next(iter(sizes.values()))
    largest = sorted(sizes.values(), reverse=True)[:2]
    return (model_rooted + (2 * largest[0] if len(largest) == 2 else sum(largest)),
            model_rooted + last)
