"""How phalanx lays out trainable parameters, for the planner: the engine's own function.

The units (gradient buckets, which are also the flat units the sharded strategies cut into
shards) are decided by `phalanx.engine.units`, by the module tree under a size cap; the planner
calls the same function with what it knows of the model (each parameter's size, and the
repeated block it sits in where the model or config says), so its layout cannot drift from the
engine's. The planner needs the sizes for what scales with a unit rather than with the model:
ZeRO-2's pool of bucket buffers, the fp32 gradient that a mixed-precision step makes for one
unit at a time, the optimizer's per-call temporaries and, for zero3, the parameters gathered at
once. Under zero3 frozen parameters (a LoRA model's base) are sharded in the same units as the
trainable ones and gathered with them, so what zero3 gathers is laid out over every parameter;
what is reduced and stepped, over the trainable ones.
"""

from __future__ import annotations

import math

from ..engine.units import FIRST_UNIT_MIB, unit_caps, unit_numels

__all__ = ["unit_sizes", "zero3_gathering", "zero3_roots", "engine_roots", "FIRST_UNIT_MIB"]


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


def zero3_gathering(desc, compute_bytes: int, bucket_mb: float = 25.0, prefetch: int = 1,
                    max_gathered_bytes: int | None = None,
                    reshard_after_forward: bool = True) -> tuple[int, int]:
    """zero3: (elements gathered at once at most, elements kept gathered from forward to
    backward), for px.prepare's gathering options. Units are gathered together by root
    (engine/zero3.py): the units rooted at the model itself, and the root the forward ends
    with, stay gathered into backward; of the other roots, the one computing and up to
    `prefetch` ahead are gathered at once, as many as fit in `max_gathered_bytes` (one at least:
    a root needed now is gathered whatever its size); `reshard_after_forward=False` keeps every
    root from its forward to its backward, so all are gathered at the end of the forward. The
    roots are those `zero3_roots` gives; where none are known (a bare count) each unit stands
    for a root and none is kept."""
    known = desc.zero3_roots is not None or desc.module is not None
    model_rooted, sizes = zero3_roots(desc, compute_bytes, bucket_mb)
    last = next(iter(sizes.values()), 0)  # the root the forward ends with, kept
    if not sizes and not known:
        units = unit_sizes(desc.param_shapes, desc.params, compute_bytes, bucket_mb,
                           desc.param_blocks)
        sizes, last = dict(enumerate(units)), 0
    if not reshard_after_forward:
        everything = model_rooted + sum(sizes.values())
        return everything, everything
    largest = max(sizes.values(), default=0)
    at_once = min(prefetch + 1, len(sizes))
    if max_gathered_bytes is not None and largest:
        room = max_gathered_bytes // compute_bytes - model_rooted
        at_once = max(1, min(at_once, room // largest))
    return model_rooted + at_once * largest, model_rooted + last


def zero3_roots(desc, compute_bytes: int, bucket_mb: float = 25.0) -> tuple[int, dict]:
    """(elements of the units rooted at the model itself, {root: elements} of the other
    roots in backward order, the root the forward ends with first), frozen parameters included
    (zero3 shards and gathers them in the units of the trainable ones). From what a run's engine
    recorded (`desc.zero3_roots`, see `engine_roots`); from a module, the engine's own roots,
    the last registered taken as the last to run; from a config, each repeated block is a root
    and the rest is left out (a model-level embedding tied to the head would add its size);
    from a bare count, none."""
    if desc.zero3_roots is not None:
        pairs = [(root, numel) for root, numel in desc.zero3_roots]
    elif desc.module is not None:
        from ..engine.units import module_units, unit_roots

        params = list(desc.module.parameters())  # frozen ones too: zero3 gathers them
        runs = module_units(desc.module, params, compute_bytes, bucket_mb, desc.block_classes)
        pairs = [(root, sum(p.numel() for p in run))
                 for run, root in zip(runs, unit_roots(desc.module, runs, desc.block_classes))]
    else:
        shapes, blocks = desc.param_shapes, desc.param_blocks
        pairs = [(block, math.prod(shape))
                 for shape, block in reversed(list(zip(shapes or [], blocks or [])))
                 if block is not None]
    sizes: dict = {}
    for root, numel in pairs:
        sizes[root] = sizes.get(root, 0) + numel
    return sizes.pop("", 0), sizes


def engine_roots(engine) -> dict | None:
    """What a zero3 engine gathers together, for RUN_DIR/run.json: px.prepare records it, and
    `phalanx report` plans the run with it (`ModelDesc.zero3_roots` and px.prepare's
    gathering options), since a parameter count alone does not say which units stay gathered
    from forward into backward. The roots are [name, trainable elements] in the engine's
    order (backward's; "" is the model itself). None for a strategy that gathers nothing."""
    gatherer = getattr(engine, "gatherer", None)
    if gatherer is None:
        return None
    return {"roots": [[root.name, sum(p.numel() for unit in root.units for p in unit.params)]
                      for root in gatherer.roots],
            "prefetch": gatherer.prefetch,
            "max_gathered_mb": None if gatherer.limit is None else gatherer.limit / 2**20,
            "reshard_after_forward": gatherer.reshard_after_forward}
