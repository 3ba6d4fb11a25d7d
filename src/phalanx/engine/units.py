"""Which parameters form a unit: decided here, once, for the engine and the planner alike.

A unit is the run of parameters whose gradients are reduced by one collective and whose flat
buffer is sharded, gathered and stepped together. Units follow the module tree: each repeated
block (a child of the model's largest `nn.ModuleList` holding more than one module: transformer
layers, ResNet stages; or each outermost instance of the classes named by `px.prepare(...,
blocks=...)`) starts a unit of its own, so a unit never mixes two layers, and what sits
outside the blocks (embeddings, the head, norms) is grouped between them. Within that, a size
cap in bytes of the compute dtype splits large runs: the first unit (the last parameters of the
model, whose gradients arrive first in backward) is capped at 1 MiB so its collective starts
early; the others at `bucket_mb`. A parameter larger than the cap is a unit of its own.

Parameters are taken in reverse registration order, about the order backward produces them in.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["find_blocks", "output_layer", "own_roots", "resolve_block_classes", "plan_units",
           "module_units", "unit_caps", "unit_numels", "unit_roots", "step_runs",
           "step_run_bytes", "FIRST_UNIT_MIB", "borrows", "borrowing"]

FIRST_UNIT_MIB = 1.0


def find_blocks(module: nn.Module, classes: tuple[type, ...] | None = None) -> list[nn.Module]:
    """The repeated layers: the outermost instances of `classes` when given (px.prepare's
    `blocks=`), else the children of the ModuleList holding the most parameters."""
    if classes:
        found: list[nn.Module] = []

        def visit(parent):
            for child in parent.children():
                if isinstance(child, classes):
                    found.append(child)
                else:
                    visit(child)
        visit(module)
        return found
    best, best_params = [], 0
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 1:
            n = sum(p.numel() for p in sub.parameters())
            if n > best_params:
                best, best_params = list(sub), n
    return best


def output_layer(module: nn.Module, classes: tuple[type, ...] | None = None):
    """The model's output layer: what `get_output_embeddings()` returns where the model, or a
    model it holds, has it (Hugging Face's models, and PEFT's around them), else the last
    nn.Linear registered outside the repeated blocks (`find_blocks`), None in a model without
    blocks. A 4-bit base leaves it in the compute dtype (model/nf4_base.py), as bitsandbytes
    leaves Hugging Face's output embeddings, and px.linear_cross_entropy computes the loss
    from its weight."""
    found = _named_by(module, "get_output_embeddings")
    if found is not None:
        return found
    blocks = find_blocks(module, classes)
    if not blocks:
        return None
    inside = {id(m) for block in blocks for m in block.modules()}
    outside = [m for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in inside]
    return outside[-1] if outside else None


def resolve_block_classes(model: nn.Module, blocks) -> tuple[type, ...] | None:
    """`blocks=` of px.prepare and px.plan as a tuple of classes, each with an instance in the
    model (checked before any collective: the same model and option fail alike on every
    rank); None stays None (the default rule of `find_blocks`)."""
    if blocks is None:
        return None
    given = list(blocks) if isinstance(blocks, (tuple, list)) else [blocks]
    present: dict[str, list[type]] = {}
    for m in model.modules():
        same = present.setdefault(type(m).__name__, [])
        if type(m) not in same:
            same.append(type(m))
    classes = []
    for b in given:
        if isinstance(b, str):
            if b not in present:
                raise ValueError(f"blocks: no module of class {b!r} in the model (its classes: "
                                 f"{', '.join(sorted(present)[:12])})")
            named = present[b]  # every class of that name
        elif isinstance(b, type) and issubclass(b, nn.Module):
            named = [b]
        else:
            raise ValueError(f"blocks={blocks!r}: a module class, a class name, or a tuple of "
                             "them")
        for cls in named:
            if issubclass(cls, (nn.ModuleList, nn.ModuleDict)):
                raise ValueError(f"blocks: {cls.__name__} is a container that is never called; "
                                 "name the class of the layers it holds")
        if not any(isinstance(m, tuple(named)) for m in model.modules()):
            raise ValueError(f"blocks: no module of class {b.__name__!r} in the model")
        classes.extend(named)
    if isinstance(model, tuple(classes)):
        raise ValueError(f"blocks: the model itself is a {type(model).__name__}; name the class "
                         "of its repeated layers")
    return tuple(classes)


def unit_caps(bucket_mb: float, itemsize: int) -> tuple[int, int]:
    """(first cap, cap) in elements of `itemsize` bytes."""
    cap = max(1, int(bucket_mb * 2**20) // itemsize)
    first = min(cap, max(1, int(FIRST_UNIT_MIB * 2**20) // itemsize))
    return first, cap


def plan_units(entries, first_cap: int, cap: int) -> list[list[int]]:
    """Cut `entries`, a sequence of `(numel, block, key)` in backward order, into units.

    `block` is the repeated block an entry belongs to (None outside blocks): a change of block
    closes the unit. `key` (dtype, device) must agree within a unit. Returns lists of indices
    into `entries`.
    """
    units: list[list[int]] = []
    current: list[int] = []
    size, limit, where = 0, first_cap, None
    for i, (numel, block, key) in enumerate(entries):
        here = (block, key)
        if current and (here != where or size + numel > limit):
            units.append(current)
            current, size, limit = [], 0, cap
        current.append(i)
        size += numel
        where = here
    if current:
        units.append(current)
    return units


def module_units(module: nn.Module, params: list[torch.Tensor], itemsize: int,
                 bucket_mb: float, block_classes=None,
                 compute: torch.dtype | None = None) -> list[list[torch.Tensor]]:
    """The units of `params` (parameters of `module`, in registration order: the trainable
    ones, and under zero3 the frozen ones too), for a compute dtype of `itemsize` bytes. A unit
    holds one flat dtype (`compute`, else the parameters' own) and, among its trainable
    parameters, one master dtype; a frozen parameter, which has no master, joins the trainable
    ones of the model's master dtype."""
    block_of = {}
    for b, block in enumerate(find_blocks(module, block_classes)):
        for p in block.parameters():
            block_of.setdefault(p, b)
    master = next((p.dtype for p in params if p.requires_grad), None)
    ordered = list(reversed(params))
    entries = [(p.numel(), block_of.get(p),
                (compute or p.dtype, p.device, p.dtype if p.requires_grad else master))
               for p in ordered]
    first, cap = unit_caps(bucket_mb, itemsize)
    return [[ordered[i] for i in unit] for unit in plan_units(entries, first, cap)]


def step_runs(grad_bytes: list[int], budget: int) -> list[list[int]]:
    """The runs of units the optimizer steps together when each needs a gradient made in the
    master dtype (`grad_bytes` per unit, in order): consecutive units up to `budget` bytes, a
    unit over it alone. The planner counts the same runs.

    [Note: fp32 gradients a few units at a time]
    The optimizer skips parameters whose `.grad` is None, and an element-wise optimizer keeps
    per-tensor state, so stepping some units' pieces at a time is the same update as stepping
    all at once. When the reduced gradient already is in the master dtype and needs no
    unscaling it is the piece's gradient itself, and every unit steps in one call
    (FlatEngine.step_units). With bf16/fp16 compute the optimizer needs gradients in the master
    dtype: made all at once they would add 4 bytes per owned parameter at the peak, so they are
    made for a run of units at a time, up to `step_run_bytes` (four buckets' worth by default),
    and each run's all-gather is on the wire while the next run steps. The optimizer's step
    hooks run once per run of units.
    """
    runs: list[list[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(grad_bytes):
        if runs[-1] and size + nbytes > budget:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += nbytes
    return runs if runs[-1] else []


def step_run_bytes(bucket_mb: float) -> int:
    """The budget of a run: four buckets' worth of gradients in the master dtype."""
    return int(4 * bucket_mb * 2**20)


def unit_numels(numels, blocks, itemsize: int, bucket_mb: float) -> list[int]:
    """Elements per unit for the planner: `numels` and `blocks` per trainable parameter in
    registration order (blocks may be None where unknown)."""
    blocks = blocks if blocks is not None else [None] * len(numels)
    entries = [(n, b, None) for n, b in zip(reversed(numels), reversed(blocks))]
    first, cap = unit_caps(bucket_mb, itemsize)
    return [sum(entries[i][0] for i in unit) for unit in plan_units(entries, first, cap)] or [0]


def borrows(numels: list[int], world: int, align: int = 1) -> bool:
    """Whether a unit of parameters of `numels` elements borrows its full-gradient buffer from
    the pool under sharded gradients on `world` ranks: more than one parameter, or one that
    `world` shards of `align` elements (buckets.py) do not divide (a lone parameter's gradient
    is reduced in the tensor autograd made: see [Note: a gradient reduced where autograd made
    it] in buckets.py)."""
    return len(numels) > 1 or numels[0] % (world * align) != 0


def borrowing(numels, blocks, itemsize: int, bucket_mb: float, world: int) -> tuple[int, int]:
    """(elements of the largest unit that `borrows`, of the largest that does not), 0 where
    there is none, for the planner: `numels` and `blocks` per trainable parameter in
    registration order, as in `unit_numels`."""
    blocks = blocks if blocks is not None else [None] * len(numels)
    entries = [(n, b, None) for n, b in zip(reversed(numels), reversed(blocks))]
    first, cap = unit_caps(bucket_mb, itemsize)
    units = [[entries[i][0] for i in unit] for unit in plan_units(entries, first, cap)]
    return (max((sum(u) for u in units if borrows(u, world)), default=0),
            max((sum(u) for u in units if not borrows(u, world)), default=0))


# -- zero3: where each unit is gathered (engine/zero3.py) -------------------------------------
def _owners(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> the qualified names of the modules that register it."""
    owners: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for p in sub._parameters.values():
            if p is not None:
                owners.setdefault(id(p), [])
                if name not in owners[id(p)]:
                    owners[id(p)].append(name)
    return owners


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") if n else [] for n in names]
    common = []
    for level in zip(*parts):
        if all(x == level[0] for x in level):
            common.append(level[0])
        else:
            break
    return ".".join(common)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _callable_root(common: str, blocks: list[str], modules: dict, own: list[str]) -> str:
    """The module whose forward brackets every use of a unit's parameters.

    The common ancestor of the registering modules is not always called: torch's own
    MultiheadAttention reads `out_proj.weight` in its forward without calling `out_proj`. So
    the root is lifted to the repeated block the unit sits in (units.py never mixes blocks),
    else to the model's token embedding or output layer when the unit sits in one
    (`own_roots`), else to the model's child that holds it (an element, for a child that is a
    container), else the model itself."""
    for outer in blocks + own:
        if common == outer or common.startswith(outer + "."):
            return outer
    parts = common.split(".") if common else []
    if not parts:
        return ""
    if isinstance(modules[parts[0]], _CONTAINERS):
        return ".".join(parts[:2]) if len(parts) >= 2 else ""
    return parts[0]


def own_roots(module: nn.Module) -> list[str]:
    """The qualified names of the model's token embedding and output layer, each a root of its
    own wherever it sits: what `get_input_embeddings()` and `get_output_embeddings()` return
    (Hugging Face's models, and PEFT's around them, where it is the adapter's wrapper, whose
    forward brackets its reads of the base weight), asked of the model itself or of one it
    holds (a module of the user's around it, computing its loss). Every such model calls each
    once a forward, and nothing else reads them (a head tied to the embedding registers the
    weight twice, which lifts the unit above both). Lifted to the model's child, a causal LM's
    embedding (`model.embed_tokens`, inside the decoder) would stay gathered through the
    decoder's whole forward and again its whole backward, and inside a module of the user's
    the head too (the whole LM is that module's child): 525M elements each at Llama 3's size,
    beside every layer gathered. Empty for a model without the methods: its embedding and head
    are rooted by the rules of `_callable_root` (a child of the model, or an element of a
    container, is its own root already)."""
    found = [_named_by(module, m) for m in ("get_input_embeddings", "get_output_embeddings")]
    names = {id(m): n for n, m in module.named_modules() if n}
    return [names[id(m)] for m in found if m is not None and id(m) in names]


def _named_by(module: nn.Module, method: str):
    """The submodule that the outermost module holding `method` (Hugging Face's
    `get_input_embeddings`, `get_output_embeddings`) names: the model itself, or a model
    wrapped in a module of the user's (one whose forward computes its loss), else None."""
    for sub in module.modules():
        named = getattr(sub, method, None)
        if not callable(named):
            continue
        try:
            found = named()
        except (AttributeError, NotImplementedError):
            continue
        if isinstance(found, nn.Module):
            return found
    return None


def unit_roots(module: nn.Module, runs, block_classes=None) -> list[str]:
    """The root (a module's qualified name, "" for the model) of each unit, given as the list of
    its parameters: the module whose forward brackets every use of them. The planner reads it
    too: units rooted at the model are gathered once per forward and backward, not twice."""
    owners = _owners(module)
    modules = dict(module.named_modules(remove_duplicate=False))
    names_of = {id(m): n for n, m in modules.items()}
    blocks = [names_of[id(b)] for b in find_blocks(module, block_classes)]
    own = own_roots(module)
    return [_callable_root(_common_prefix([n for p in run for n in owners.get(id(p), [""])]),
                           blocks, modules, own) for run in runs]
