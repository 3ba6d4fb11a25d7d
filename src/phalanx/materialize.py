"""A model built on the meta device, given real storage and initial values by `px.prepare`.

`with torch.device("meta"): model = Big()` builds the module tree with no storage at all. Here
every module gets empty storage on the rank's device and its initial values from, in order:
`init(model)` when the user passes one, else each module's own `reset_parameters()`, module by
module in `model.modules()` order, which for PyTorch's layers (Linear, Embedding, LayerNorm,
convolutions...) built in that order is the order their constructors drew random numbers in.
A meta build draws none, so with the generator where it was before the build (seeded as for a
full build), the values are those a full build would have. Every rank starts from rank 0's
generator state, so the ranks agree without a broadcast of the model.

Parameters registered in several modules (tied embeddings) are materialised apart for the
initialisation, so each module's `reset_parameters` draws what it drew in the full build, and
tied again after it to the values of the module that registered the parameter first, the one
whose tensor a full build keeps. The optimizer built over the meta parameters is pointed at the
new ones.

Modules whose construction initialises several things in another order (torch's
MultiheadAttention draws its output projection before its input projection) need `init=`.

[Note: only the shards are kept]
Under zero3 (more than one rank, no `init=`) the values are drawn after the engine is built, so
that no rank ever holds the whole model: `materialize(..., values=False)` gives every parameter
storage that is never written (pages the kernel maps only when touched) and the engine lays its
units out over it, keeping masters of the owned slices only; then `fill_shards` runs each
module's `reset_parameters()` in order on temporary tensors for that module's own parameters,
copies the owned pieces into the masters (frozen parameters whole) and drops the rest. The
generator draws exactly what the full build draws, so the values are the same; what exists at
once is the masters plus one module's parameters. A `reset_parameters` that writes parameters of
other modules cannot be split this way: pass `init=`, and the whole model is materialised first
(4 bytes per fp32 parameter, once, before zero3 keeps 1/N of it).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["on_meta", "materialize", "fill_shards"]


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _same_generator_state(comm) -> None:
    if comm.world == 1:
        return
    state = torch.get_rng_state()
    comm.broadcast(state, src=0, tag="materialize:rng")
    torch.set_rng_state(state)


@torch.no_grad()
def materialize(model: nn.Module, optimizer, device: torch.device, comm, init=None, *,
                values: bool = True) -> None:
    """Give `model` storage on `device` and its initial values (see the module's docstring);
    `values=False`: storage only, for `fill_shards` after the engine is built."""
    if init is None:  # what only a constructor fills would stay garbage: refuse it
        for name, module in model.named_modules():
            for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
                for attr, t in tensors.items():
                    if t is not None and t.is_meta and not callable(
                            getattr(module, "reset_parameters", None)):
                        raise ValueError(
                            f"the {kind} {(name + '.' if name else '') + attr!r} is on the meta "
                            f"device and {type(module).__name__} has no reset_parameters() to "
                            "fill it: pass px.prepare(..., init=fn), fn(model) setting every "
                            "parameter and buffer, or build that module on a real device")
    if values:
        _same_generator_state(comm)
    places = _places(model)
    old_names = {id(p): name for name, p in model.named_parameters()}
    # Untie: each registration its own parameter for the initialisation.
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[attr] = nn.Parameter(
                    torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        for attr, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[attr] = torch.empty_like(b, device=device)
    if values and init is not None:
        init(model)
    elif values:
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


@torch.no_grad()
def fill_shards(model: nn.Module, pieces: dict, comm) -> None:
    """See [Note: only the shards are kept]. `pieces`: id(param) -> the master pieces this rank
    holds (the engine's `master_pieces()`), for every parameter the engine manages."""
    _same_generator_state(comm)
    first = {key: where[0] for key, where in _places(model).items()}
    for name, module in model.named_modules():
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            continue
        real = dict(module._parameters)
        for attr, p in real.items():
            if p is not None:
                module._parameters[attr] = nn.Parameter(torch.empty_like(p),
                                                        requires_grad=p.requires_grad)
        try:
            reset()
        except RuntimeError as exc:
            raise RuntimeError(
                f"{type(module).__name__}.reset_parameters() of {name or 'the model'!r} failed "
                "while zero3 initialised the model one module at a time (it may write "
                "parameters of other modules); pass px.prepare(..., init=fn), fn(model) "
                f"setting every parameter and buffer: {exc}") from exc
        drawn = dict(module._parameters)
        module._parameters.update(real)
        for attr, p in real.items():
            if p is None or first[id(p)] != (module, attr):
                continue  # a tie: the first registrant's values are the ones kept
            value = drawn[attr].detach().reshape(-1)
            if id(p) in pieces:
                for piece in pieces[id(p)]:
                    piece.master.view(-1).copy_(value[piece.start:piece.end])
            else:
                p.copy_(drawn[attr])
