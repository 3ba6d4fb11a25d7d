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

A PEFT model's adapters are drawn with the same `draw_modules`, in the order `get_peft_model`
draws them ([Note: a PEFT model reads the plain model's files] in model/peft_names.py), with
`only` the parameters of each pass drawn, the others staying meta stand-ins whose writes are
dropped; into the pieces each rank owns under zero3, into the parameters otherwise, from rank
0's generator either way. With `init=px.from_safetensors(...)`, only the adapters, which no
file has. With no `init=` (`plain_draws`), under every strategy, first the base (each module's
`reset_parameters()` in order, the adapters' parameters left out), then the adapters: so a meta
build has the values of a whole build from the same seed, LoRA's B zero among them.
"""

from __future__ import annotations

import torch
from torch import nn

from . import peft_names

__all__ = ["on_meta", "materialize", "fill_shards", "has_room", "draw_modules", "plain_draws"]

# Why draw_modules runs one module at a time, and the way out when a module cannot run alone
ZERO3 = ("zero3 initialises the model one module at a time",
         "pass px.prepare(..., init=fn), fn(model) setting every parameter and buffer")
PEFT_META = ("a PEFT model built on the meta device is drawn one module at a time, its base "
             "first and its adapters after it, as get_peft_model draws them",
             "pass px.prepare(..., init=fn), fn(model) setting every parameter and buffer, or "
             "build the model off the meta device")
ADAPTERS_NO_FILE = ("the adapters that no file has are drawn one module at a time",
                    "build the model off the meta device (its adapters then keep their values)")


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
    plain = []
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
        plain = plain_draws(model)  # refuses a PEFT initialisation it cannot draw
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
    elif draws and len(plain) > 1:  # a PEFT model: its base, then its adapters
        for calls, only, why in plain:
            draw_modules(model, calls, {}, {}, only, why)
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
        if values:  # zero3 draws into its pieces in fill_shards
            _draw_missing(model, reading, {}, comm, {})
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
        _draw_missing(model, reading, pieces, comm, dtypes)
        return
    _same_generator_state(comm)
    for calls, only, why in plain_draws(model):
        draw_modules(model, calls, pieces, dtypes, only, why)


def plain_draws(model: nn.Module) -> list[tuple[list, set | None, tuple[str, str]]]:
    """What draws a meta build given no `init=`, as runs of `draw_modules` (calls, only,
    why): each module's `reset_parameters()` in `model.modules()` order; for a PEFT model
    (model/peft_names.py), those of its base first, the adapters' parameters left out (a
    module holding nothing else is skipped), then its adapters as `get_peft_model` draws them.
    Raises ValueError for a PEFT initialisation that a meta build cannot draw."""
    resets = [(name, m, m.reset_parameters, "reset_parameters()")
              for name, m in model.named_modules()
              if callable(getattr(m, "reset_parameters", None))]
    adapters = peft_names.adapters(model)
    if not adapters:
        return [(resets, None, ZERO3)]
    problems: list[str] = []
    order, inits = peft_names.draw_order(model, adapters, problems, keep_undrawn=True)
    if problems:
        raise ValueError("; ".join(problems))
    drawn = {(model.get_submodule(path), attr) for path, attr in adapters}
    base = {key for where in _places(model).values() if where[0] not in drawn for key in where}
    held = {id(m): [(m, a) for a, p in m._parameters.items() if p is not None]
            for m in model.modules()}
    base_resets = [call for call in resets
                   if not (keys := [k for sub in call[1].modules() for k in held[id(sub)]])
                   or any(k in base for k in keys)]
    return [(base_resets, base, PEFT_META),
            (peft_names.draw_calls(model, order, inits), drawn, PEFT_META)]


def _draw_missing(model: nn.Module, reading, pieces: dict, comm, dtypes: dict) -> None:
    """Draw the parameters of `reading` (px.from_safetensors) that no file has."""
    calls, only = reading.adapters.draws()
    if calls:
        _same_generator_state(comm)
        draw_modules(model, calls, pieces, dtypes, only, ADAPTERS_NO_FILE)


@torch.no_grad()
def draw_modules(model: nn.Module, draws: list, pieces: dict, dtypes: dict,
                 only: set | None = None, why: tuple[str, str] = ZERO3) -> None:
    """Run each of `draws` ((name, module, fn, what fn is called), in order) with CPU
    temporaries for the parameters of its module (of its module tree, if it writes those),
    and copy what it drew into each parameter, or into the pieces of it this rank holds
    (`pieces`, as fill_shards takes them). `only`: the (module, attribute) of the parameters
    drawn; the others stay meta stand-ins, what is written into them dropped (None: all).
    `why`: why the modules are run one at a time, and what to do instead, for the errors."""
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
        for name, module, reset, what in draws:
            tree = [key for sub in module.modules() for key in by_module.get(id(sub), [])]
            subtree = [key for key in tree if only is None or key in only]
            own = [key for key in by_module.get(id(module), []) if only is None or key in only]
            rng = torch.get_rng_state()
            args = (module, name, reset, what, real, stand_in, dtypes, why)
            drawn, written = _draw(own, *args)
            if set(written) & set(subtree):  # it initialises its children: again, with them
                torch.set_rng_state(rng)
                drawn, written = _draw(subtree, *args)
            inside = set(tree)  # a stand-in written there is one `only` leaves: dropped
            written = [key for key in written if key not in inside]
            if written:
                raise RuntimeError(
                    f"{type(module).__name__}.{what} of {name or 'the model'!r} "
                    f"writes {names[written[0]]!r}, outside its own module tree, but {why[0]}: "
                    f"{why[1]}")
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


def _draw(keys, module, name, reset, what, real, stand_in, dtypes, why) -> tuple[dict, list]:
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
            f"{type(module).__name__}.{what} of {name or 'the model'!r} failed, run alone "
            f"because {why[0]} ({why[1]}): {exc}") from exc
    finally:
        _swap({key: stand_in[key] for key in temps})
    return temps, [key for key, t in stand_in.items() if t._version != seen[key]]
