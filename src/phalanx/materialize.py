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
Every rank materialises the whole model once, 4 bytes per fp32 parameter, before zero3 keeps
1/N of it: a model whose training state does not fit a rank, but whose parameters do, trains.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["on_meta", "materialize"]


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _same_generator_state(comm) -> None:
    if comm.world == 1:
        return
    state = torch.get_rng_state()
    comm.broadcast(state, src=0, tag="materialize:rng")
    torch.set_rng_state(state)


@torch.no_grad()
def materialize(model: nn.Module, optimizer, device: torch.device, comm, init=None) -> None:
    """Give `model` storage on `device` and its initial values (see the module's docstring)."""
    if init is None:  # a buffer only a constructor fills would stay garbage: refuse it
        for name, module in model.named_modules():
            for attr, b in module._buffers.items():
                if b is not None and b.is_meta and not callable(
                        getattr(module, "reset_parameters", None)):
                    raise ValueError(
                        f"the buffer {(name + '.' if name else '') + attr!r} is on the meta "
                        f"device and {type(module).__name__} has no reset_parameters() to "
                        "fill it: pass px.prepare(..., init=fn), fn(model) setting every "
                        "parameter and buffer, or build that module on a real device")
    _same_generator_state(comm)
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, attr))
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
    if init is not None:
        init(model)
    else:
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
