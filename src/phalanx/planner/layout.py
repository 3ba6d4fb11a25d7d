"""How phalanx lays out parameters in units, for the planner: the engine's own function.

The units (gradient buckets, which are also the flat units the sharded strategies cut into
shards) are decided by `phalanx.engine.units`, by the module tree under a size cap; the planner
calls the same function with what it knows of the model (each parameter's size, and the
repeated block it sits in where the model or config says), so its layout cannot drift from the
engine's. The planner needs the sizes for what scales with a unit rather than with the model:
ZeRO-2's pool of bucket buffers, the fp32 gradient that a mixed-precision step makes for one
unit at a time, the optimizer's per-call temporaries and, for zero3, the parameters gathered at
once. Under zero3 (on more than one rank) frozen parameters (a LoRA model's base) are laid
out with the trainable ones, in the units of the modules that hold them (see [Note: frozen
parameters in a unit] in engine/flat.py): a unit is [trainable | frozen], each segment padded
to the world size and sharded; what is reduced and stepped is the trainable segment, and units
of frozen parameters only are neither. `engine_units` gives each unit's two segments, as the
engine cuts them, for every description that says enough: a module (the engine's own
`module_units` on it), shapes with the trainable ones marked (a config, LoRA on a config), and
otherwise the trainable parameters and the frozen ones as two counts.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass, field

from torch import nn

from ..engine.units import (
    FIRST_UNIT_MIB,
    borrows,
    module_units,
    output_layer,
    plan_units,
    unit_caps,
    unit_numels,
    unit_roots,
)
from .reference_model import on_meta

__all__ = ["Unit", "engine_units", "alike", "owned_elements", "shard_elements", "lending",
           "unit_sizes", "zero3_gathering", "window", "in_flight", "zero3_roots", "module_roots",
           "config_roots",
           "FIRST_UNIT_MIB"]


@dataclass(frozen=True)
class Unit:
    """One unit of the engine: the elements of each of its trainable parameters (in a count,
    `known` False, one number for all of them), and of its frozen ones (zero3)."""

    trained: tuple[int, ...]
    frozen: int = 0
    known: bool = True
    trainable: int = field(init=False)  # sum(trained), kept: a plan reads it per unit, often

    def __post_init__(self):
        object.__setattr__(self, "trainable", sum(self.trained))


def engine_units(desc, zero3: bool, compute_dtype, compute_bytes: int,
                 bucket_mb: float = 25.0) -> list[Unit]:
    """The engine's units of the model `desc` describes, those with trainable parameters first
    in the order they step (backward's), then units of frozen parameters only. `zero3`: the
    strategy shards parameters (zero3 on more than one rank), so frozen ones are laid out too;
    `compute_dtype`: the precision's (None: each parameter's own)."""
    if desc.module is not None and desc.trainable_shapes is not None:  # its own flags
        members = [p for p in desc.module.parameters()
                   if p.requires_grad or (zero3 and p.is_floating_point())]
        runs = module_units(desc.module, members, compute_bytes, bucket_mb, desc.block_classes,
                            compute_dtype) if members else []
        units = [Unit(tuple(p.numel() for p in run if p.requires_grad),
                      sum(p.numel() for p in run if not p.requires_grad)) for run in runs]
    elif zero3 and desc.param_trainable is not None:
        units = _cut(desc.param_shapes, desc.param_blocks, desc.param_trainable, compute_bytes,
                     bucket_mb)
    else:
        if desc.trainable_shapes is not None:
            units = _cut(desc.trainable_shapes, desc.trainable_blocks, None, compute_bytes,
                         bucket_mb)
        else:
            units = [Unit((n,), known=False) for n in
                     unit_sizes(None, desc.trainable_params, compute_bytes, bucket_mb) if n]
        if zero3 and desc.frozen_params:  # where they sit is not known: laid out as a count
            units += [Unit((), n, known=False)
                      for n in unit_sizes(None, desc.frozen_params, compute_bytes, bucket_mb)]
    return [u for u in units if u.trained] + [u for u in units if not u.trained]


def _cut(shapes, blocks, trainable, compute_bytes: int, bucket_mb: float) -> list[Unit]:
    """Units of parameters of `shapes` (registration order), in the repeated block `blocks`
    says, `trainable` marking those that learn (None: all do), cut as engine/units.py cuts
    them."""
    numels = [math.prod(s) for s in shapes]
    blocks = blocks if blocks is not None else [None] * len(numels)
    trainable = trainable if trainable is not None else [True] * len(numels)
    entries = list(reversed(list(zip(numels, blocks, trainable))))
    first, cap = unit_caps(bucket_mb, compute_bytes)
    out = []
    for unit in plan_units([(n, b, None) for n, b, _ in entries], first, cap):
        out.append(Unit(tuple(entries[i][0] for i in unit if entries[i][2]),
                        sum(entries[i][0] for i in unit if not entries[i][2])))
    return out


def alike(units: list[Unit]) -> list[tuple[Unit, int]]:
    """Each distinct unit and how many there are: a model given as a count of a trillion
    parameters has tens of thousands of units of three sizes, and a plan asks about many
    world sizes (counted on tuples, whose hashing is the interpreter's own)."""
    keys = collections.Counter((u.trained, u.frozen, u.known) for u in units)
    return [(Unit(*key), k) for key, k in keys.items()]


def owned_elements(grouped: list[tuple[Unit, int]], world: int,
                   align: int = 1) -> tuple[int, int]:
    """(trainable, frozen) elements of the shards the first rank owns, the most any rank
    does: each unit's segment padded to a multiple of `world` and cut in `world` slices
    (engine/flat.py). `grouped`: the units as `alike` counts them. `world` 1: everything.
    `align`: a block-wise quantized optimizer's block on more than one rank: each trainable
    parameter starts at a multiple of it and each slice is a multiple of it, so that a shard
    boundary falls on a block boundary (engine/buckets.py's aligned layout)."""
    return (sum(k * shard_elements(u, world, align) for u, k in grouped),
            sum(k * -(-u.frozen // world) for u, k in grouped))


def shard_elements(unit: Unit, world: int, align: int = 1) -> int:
    """The elements of one rank's slice of the unit's trainable segment (see
    `owned_elements`)."""
    if align <= 1 or world <= 1 or not unit.trained:
        return -(-unit.trainable // world)
    sizes = unit.trained if unit.known else (unit.trainable,)
    end = sum(-(-n // align) * align for n in sizes[:-1]) + sizes[-1]
    return -(-end // (world * align)) * align


def lending(grouped: list[tuple[Unit, int]], world: int) -> tuple[int, int]:
    """(trainable elements of the largest unit that borrows its full-gradient buffer from the
    pool, of the largest that does not), as engine/units.py's `borrows` decides on `world`
    ranks; a unit laid out as a count is taken to borrow. `grouped`: as `alike` counts them."""
    trained = [u for u, _ in grouped if u.trained]
    return (max((u.trainable for u in trained
                 if not u.known or borrows(list(u.trained), world)), default=0),
            max((u.trainable for u in trained
                 if u.known and not borrows(list(u.trained), world)), default=0))


def in_flight(trained: list[Unit], world: int) -> tuple[int, int]:
    """zero3 on `world` ranks, the units with trainable parameters in backward's order:
    (elements of the gradients of two consecutive units that do not borrow, the most at once;
    elements of the largest parameter of a unit that does, whose gradient is made and then
    copied into the pool), memory.py's `in_flight` (see [Note: Engine buffers] there). A unit
    laid out as a count is taken to borrow, as one parameter as large as itself."""
    pooled = [not u.known or borrows(list(u.trained), world) for u in trained]
    lone = [0 if p else u.trainable for u, p in zip(trained, pooled)]
    staged = max((max(u.trained) if u.known else u.trainable
                  for u, p in zip(trained, pooled) if p), default=0)
    return window(lone, 2), staged


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
                    reshard_after_forward: bool = True, ratio: float = 1.0) -> tuple[int, int]:
    """zero3: (elements gathered at once at most, elements backward does not gather again), for
    px.prepare's gathering options. Units are gathered together by root (engine/zero3.py): the units
    rooted at the model itself, and the root the forward ends with, stay gathered into backward, and
    a root that backward never reaches (frozen, before every trainable parameter: a LoRA model's
    embedding) is not gathered there; of the other roots, the one computing and up to `prefetch`
    ahead are gathered at once, as many as fit in `max_gathered_bytes` (one at least: a root needed
    now is gathered whatever its size), the ones beside it in the order they run (`window`);
    `reshard_after_forward=False` keeps every root from its forward to its backward, so all are
    gathered at the end of the forward. The roots are those
    `zero3_roots` gives; where none are known (a bare count) each unit stands for a root and none is
    kept. `ratio`: what a frozen nn.Linear weight's element weighs against the compute dtype's
    (a 4-bit base's NF4 bytes over the compute dtype's; 1: stored as the others), so that the
    counts are of compute-dtype elements that weigh as much as what is gathered (from a bare
    count, every frozen parameter taken for such a weight)."""
    known = desc.zero3_roots is not None or desc.module is not None or _from_config(desc)
    model_rooted, sizes, unreached = zero3_roots(desc, compute_bytes, bucket_mb, ratio)
    last = next(iter(sizes.values()), 0)  # the root the forward ends with, kept
    if not sizes and not known:
        units = unit_sizes(desc.param_shapes, desc.params, compute_bytes, bucket_mb,
                           desc.param_blocks)
        weigh = (desc.params - desc.frozen_params * (1 - ratio)) / max(desc.params, 1)
        sizes, last = {i: n * weigh if ratio != 1 else n for i, n in enumerate(units)}, 0
    if not reshard_after_forward:
        everything = model_rooted + sum(sizes.values())
        return everything, everything
    largest = max(sizes.values(), default=0)
    at_once = min(prefetch + 1, len(sizes))
    if max_gathered_bytes is not None and largest:
        room = max_gathered_bytes // compute_bytes - model_rooted
        at_once = max(1, min(at_once, room // largest))
    return model_rooted + window(sizes, at_once), model_rooted + last + unreached


def window(sizes, width: int):
    """The most `width` consecutive entries of `sizes` add up to: what is gathered (or in
    flight) at once when each is taken with the ones beside it, in the order they run (zero3
    prefetches the root that ran after this one last time: the head with the last block, the
    embedding with the first, never the head with the embedding). `sizes`: a list, or a dict
    {root's qualified name: elements}, where a root whose forward brackets others' (a Hugging
    Face decoder holding the final norm, around its layers) is counted with each window of
    theirs: it stays gathered while they run."""
    named = sizes if isinstance(sizes, dict) else {}

    def around(name) -> set:  # the roots among `sizes` whose forward brackets this one's
        if not isinstance(name, str):
            return set()
        parts = name.split(".")
        return {a for a in (".".join(parts[:k]) for k in range(1, len(parts))) if a in named}

    # an enclosing root is counted with the roots inside it, and is no neighbour of its own (a
    # decoder holding the final norm comes between the head and the last block in backward's
    # order of units, where those two are gathered together)
    brackets_of = {n: around(n) for n in named}
    enclosing = set().union(*brackets_of.values())
    names = [n for n in named if n not in enclosing] if named else [None] * len(sizes)
    values = [named[n] for n in names] if named else list(sizes)
    if not values or width <= 0:
        return 0
    width = min(width, len(values))
    outer = [brackets_of.get(n, set()) for n in names]
    best = 0
    for i in range(len(values) - width + 1):
        brackets = set().union(*outer[i:i + width])
        best = max(best, sum(values[i:i + width]) + sum(named[a] for a in brackets))
    return best


def zero3_roots(desc, compute_bytes: int, bucket_mb: float = 25.0,
                ratio: float = 1.0) -> tuple[int, dict, int]:
    """(elements of the units rooted at the model itself, {root: elements} of the other roots in
    backward order, the root the forward ends with first, elements of the roots backward never
    reaches), frozen parameters included (zero3 shards and gathers them in the units of the
    trainable ones). A root's backward gather is started by a hook on its output, which a root whose
    output needs no gradient never gets: one holding no trainable parameter that runs before every
    one that does (known from a module or a config: a recorded run gives 0). From what a run's
    engine recorded (`desc.zero3_roots`, see engine/zero3_roots.py's `engine_roots`); from a
    module, the engine's own roots, the last registered taken as the last to run; from a
    config, the engine's own roots of the module the config describes (`config_roots`); from a
    bare count, none. `ratio`: as zero3_gathering's (a recorded run's roots are taken as they
    were)."""
    learning: dict = {}  # root -> holds a trainable parameter (from a module or a config)
    if desc.zero3_roots is not None:
        pairs = [(root, numel) for root, numel in desc.zero3_roots]
    elif desc.module is not None:
        pairs, learning = module_roots(desc.module, compute_bytes, bucket_mb, desc.block_classes,
                                       ratio)
    elif _from_config(desc):
        lora = desc.finetune or {}
        pairs, learned = config_roots(desc.transformer, compute_bytes, bucket_mb,
                                      lora.get("lora_rank"), tuple(lora.get("lora_targets", ())),
                                      ratio)
        learning = dict(learned)
    else:
        pairs = []
    sizes: dict = {}
    for root, numel in pairs:
        sizes[root] = sizes.get(root, 0) + numel
    model_rooted = sizes.pop("", 0)
    unreached = 0
    for root in list(sizes)[:0:-1]:  # forward order, up to the first root that learns (the
        if learning.get(root, True):  # one the forward ends with is kept, not counted here)
            break
        unreached += sizes[root]
    return model_rooted, sizes, unreached


def _from_config(desc) -> bool:
    """`desc` describes a model by a config's shape (finetune.py keeps it with LoRA's adapters or
    a trainable fraction), with every parameter's shape."""
    return desc.transformer is not None and desc.param_shapes is not None


def module_roots(module, compute_bytes: int, bucket_mb: float = 25.0,
                 block_classes=None, ratio: float = 1.0) -> tuple[list, dict]:
    """([(root, elements)] of each of the engine's units of `module`, in backward order; {root:
    holds a trainable parameter}), by the engine's own functions (engine/units.py). `ratio`: a
    frozen nn.Linear weight's elements counted at that weight (a 4-bit base: zero3_gathering)."""
    params = list(module.parameters())  # frozen ones too: zero3 gathers them
    runs = module_units(module, params, compute_bytes, bucket_mb, block_classes)
    output = output_layer(module, block_classes)  # a 4-bit base leaves it (nf4_base.py)
    linear = {id(m.weight) for m in module.modules()
              if isinstance(m, nn.Linear) and m is not output} if ratio != 1 else set()

    def weight(p):  # an NF4 weight: a frozen Linear's of whole 64 x 256 blocks (nf4_base.py)
        stored = not p.requires_grad and id(p) in linear and p.numel() % (64 * 256) == 0
        return p.numel() * ratio if stored else p.numel()

    pairs, learning = [], {}
    for run, root in zip(runs, unit_roots(module, runs, block_classes)):
        pairs.append((root, sum(weight(p) for p in run)))
        learning[root] = learning.get(root, False) or any(p.requires_grad for p in run)
    return pairs, learning


@functools.lru_cache(maxsize=32)  # a plan asks again for each alternative and layout
def config_roots(shape, compute_bytes: int, bucket_mb: float = 25.0, lora_rank=None,
                 lora_targets: tuple = (), ratio: float = 1.0) -> tuple[tuple, tuple]:
    """`module_roots` of the model a config describes: the reference model of its `shape`
    (reference_model.py: the config's parameters in the config's order; the embedding, the
    blocks, the final norm and the head each a child of the model, the head the embedding's weight
    when tied), built on the meta device, with LoRA's adapters where `lora_rank` says (beside
    `lora_targets`, as finetune.py adds them to a config). So a config's zero3 gathers what its
    module's does (see [Note: zero3's gather and free] in engine/zero3.py): the head, the root the
    forward ends with, stays gathered into backward (tied to the embedding, it is rooted at the
    model, gathered from the forward's start), and the embedding and the head, as large as a block
    or larger, are among the roots gathered at once."""
    module = on_meta(shape, None if lora_rank is None else (lora_rank, lora_targets))
    pairs, learning = module_roots(module, compute_bytes, bucket_mb, ratio=ratio)
    return tuple(pairs), tuple(learning.items())


