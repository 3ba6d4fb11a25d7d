"""A model built on the meta device, given real storage and initial values by `px.prepare`.

`with torch.device("meta"): model = Big()` builds the module tree with no storage at all. Here
every module gets empty storage and its initial values from, in order:
`init(model)` when the user passes one, else each module's own `reset_parameters()`, module by
module in `model.modules()` order, which for PyTorch's layers (Linear, Embedding, LayerNorm,
convolutions...) built in that order is the order their constructors drew random numbers in.
A meta build draws none, so with the generator where it was before the build (seeded as for a
full build), the values are those a full build would have. Every rank starts from rank 0's
generator state, so the ranks agree without a broadcast of the model, whatever each rank's own
seed. The values are drawn on the CPU, as a CPU build draws them, and `px.prepare` moves the
model to the rank's device afterwards: drawn on a GPU they would come from each rank's CUDA
generator, which no broadcast aligns, and differ from a CPU build's. (`init=` draws where it
chooses.) Rank 0's generator state travels on the group's own device (NCCL takes GPU tensors
only).

Parameters registered in several modules (tied embeddings) are materialised apart for the
initialisation, so each module's `reset_parameters` draws what it drew in the full build, and
tied again after it to the values of the module that registered the parameter first, the one
whose tensor a full build keeps. The optimizer built over the meta parameters is pointed at the
new ones.

Modules whose construction initialises several things in another order (torch's
MultiheadAttention draws its output projection before its input projection) need `init=`.

[Note: only the shards are kept]
Under zero3 (more than one rank, no `init=`) the values are drawn after the engine is built, so
that no rank ever holds the whole model (with `init=px.from_safetensors(...)` they are read
after it the same way, each rank reading the slices it owns: [Note: reading only what a rank
keeps] in model/pretrained.py): `materialize(..., values=False)` gives every floating
parameter, trainable or frozen, a one-element storage seen through a zero stride (its shape, no
room for values; the engine reads nothing from such a parameter and keeps the owned slices
only: [Note: frozen parameters in a unit] in engine/flat.py), buffers real storage. Then
`fill_shards` runs each module's `reset_parameters()` in order, on temporary CPU tensors in the
parameters' own dtypes (what a CPU build draws into, whatever the precision or device), copies the
owned pieces into the masters and frozen shards, and drops the rest. What exists at once is the
shards plus one module's parameters.

A `reset_parameters` may initialise its children too (a block resetting its layers): the
children's parameters are meta tensors during the first try, and if it wrote them (their version
counters moved) the generator is rewound and the call repeated with temporaries for the whole
subtree. The children's own `reset_parameters` run later in the same order as in a full
build, so the last writer wins as it does there. A `reset_parameters` writing parameters outside
its subtree cannot be split: it is refused by name, and `init=` (which materialises the whole
model first, 4 bytes per fp32 parameter, once) does it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["on_meta", "materialize", "fill_shards", "has_room"]


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _same_generator_state(comm) -> None:
    """Every rank's CPU generator at rank 0's state."""
    if comm.world == 1:
        return
    state = torch.get_rng_state().to(comm.device)
    comm.broadcast(state, src=0, tag="materialize:rng")
    torch.set_rng_state(state.cpu())


@torch.no_grad()
def materialize(model: nn.Module, optimizer, device: torch.device, comm, init=None, *,
                values: bool = True, reading=None) -> None:
    """Give `model` storage and its initial values, drawn on the CPU (see the module's
    docstring); `values=False`: storage on `device` only, for `fill_shards` after the engine
    is built. `reading` (init=px.from_safetensors: model/pretrained.py): storage on `device`,
    read into instead of drawn (zero3's trainable parameters, with `values=False`, later)."""
    places = _places(model)
    if init is None:  # what only a constructor fills would stay garbage: refuse it
        firsts = {where[0] for where in places.values()}
        for name, module in model.named_modules():
            if callable(getattr(module, "reset_parameters", None)):
                continue
            for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
                for attr, t in tensors.items():
                    if t is None or not t.is_meta or (
                            kind == "parameter" and (module, attr) not in firsts):
                        continue  # a tie: the first registrant's module fills it
                    raise ValueError(
                        f"the {kind} {(name + '.' if name else '') + attr!r} is on the meta "
                        f"device and {type(module).__name__} has no reset_parameters() to "
                        "fill it: pass px.prepare(..., init=fn), fn(model) setting every "
                        "parameter and buffer, or build that module on a real device")
    draws = values and reading is None
    if draws:
        _same_generator_state(comm)
    place = "cpu" if draws else device
    old_names = {id(p): name for name, p in model.named_parameters()}
    # Untie: each registration its own parameter for the initialisation.
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                # zero3 holds every floating parameter in shards, frozen ones too
                storage = _no_room(p, device) if not values and p.is_floating_point() \
                    else torch.empty_like(p, device=place)
                module._parameters[attr] = nn.Parameter(storage, requires_grad=p.requires_grad)
        for attr, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[attr] = torch.empty_like(b, device=place)
    if draws and init is not None:
        init(model)
    elif draws:
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    # Tie again, to the first registrant's tensor.
    for where in places.values():
        first_module, first_attr = where[0]
        keep = first_module._parameters[first_attr]
        for module, attr in where[1:]:
            module._parameters[attr] = keep
    if reading is not None:
        reading.load()
    if optimizer is not None:
        new = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [new[old_names[id(p)]] if id(p) in old_names else p
                               for p in group["params"]]


def _places(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) registering it, first registrant first."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, attr))
    return places


def _no_room(p: torch.Tensor, device) -> torch.Tensor:
    """`p`'s shape over one element of storage: nothing to read, nothing allocated."""
    return torch.empty((), dtype=p.dtype, device=device).expand(p.shape)


def has_room(t: torch.Tensor) -> bool:
    """False for a tensor made by `_no_room` (zero3's trainable parameters until the engine
    holds their masters): it has no values to read or write."""
    return t.numel() <= 1 or 0 not in t.stride()


@torch.no_grad()
def fill_shards(model: nn.Module, pieces: dict, comm, dtypes: dict, reading=None) -> None:
    """See [Note: only the shards are kept]. `pieces`: id(param) -> the pieces this rank holds
    (the engine's `held_pieces()`), for every parameter the engine holds in shards; `dtypes`:
    id(param) -> its dtype before any cast for the precision; `reading`: pretrained weights to
    read the pieces from instead (model/pretrained.py)."""
    if reading is not None:
        reading.load_pieces(pieces)
        return
    _same_generator_state(comm)
    first = {where[0] for where in _places(model).values()}
    real, names, by_module = {}, {}, {}
    for name, m in model.named_modules():
        for a, p in m._parameters.items():
            if p is not None:
                real[(m, a)] = p
                names[(m, a)] = (name + "." if name else "") + a
                by_module.setdefault(id(m), []).append((m, a))
    # Every parameter is a meta stand-in while nobody draws into it: a write from outside the
    # module being initialised moves a version counter instead of touching zero3's storage.
    stand_in = {key: nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                for key, p in real.items()}
    _swap(stand_in)
    try:
        for name, module in model.named_modules():
            reset = getattr(module, "reset_parameters", None)
            if not callable(reset):
                continue
            own = by_module.get(id(module), [])
            subtree = [key for sub in module.modules() for key in by_module.get(id(sub), [])]
            rng = torch.get_rng_state()
            drawn, written = _draw(module, name, reset, own, real, stand_in, dtypes)
            if set(written) & set(subtree):  # it initialises its children: again, with them
                torch.set_rng_state(rng)
                drawn, written = _draw(module, name, reset, subtree, real, stand_in, dtypes)
            if written:
                raise RuntimeError(
                    f"{type(module).__name__}.reset_parameters() of {name or 'the model'!r} "
                    f"writes {names[written[0]]!r}, outside its own module tree, so zero3 cannot "
                    "initialise the model one module at a time; pass px.prepare(..., init=fn), "
                    "fn(model) setting every parameter and buffer")
            for key, value in drawn.items():
                if key not in first:
                    continue  # a tie: the first registrant's values are the ones kept
                p, flat = real[key], value.reshape(-1)
                if id(p) in pieces:
                    for piece in pieces[id(p)]:
                        piece.master.view(-1).copy_(flat[piece.start:piece.end])
                else:
                    p.copy_(value)
    finally:
        _swap(real)


def _swap(tensors: dict) -> None:
    for (module, attr), p in tensors.items():
        module._parameters[attr] = p


def _draw(module, name, reset, keys, real, stand_in, dtypes) -> tuple[dict, list]:
    """Run `reset` with CPU temporaries for `keys`: (the temporaries, the other parameters whose
    stand-ins it wrote)."""
    temps = {key: nn.Parameter(torch.empty(real[key].shape,
                                           dtype=dtypes.get(id(real[key]), real[key].dtype)),
                               requires_grad=real[key].requires_grad) for key in keys}
    seen = {key: t._version for key, t in stand_in.items()}
    _swap(temps)
    try:
        reset()
    except RuntimeError as exc:
        raise RuntimeError(
            f"{type(module).__name__}.reset_parameters() of {name or 'the model'!r} failed "
            "while zero3 initialised the model one module at a time: pass "
            "px.prepare(..., init=fn), fn(model) setting every parameter and buffer: "
            f"{exc}") from exc
    finally:
        _swap({key: stand_in[key] for key in temps})
    return temps, [key for key, t in stand_in.items() if t._version != seen[key]]
