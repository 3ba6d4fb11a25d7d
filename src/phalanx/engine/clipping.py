"""Clipping by the global norm: the engine's own (`px.clip_grad_norm_`), and torch's
`clip_grad_norm_` routed to it for the models that need it.

[Note: the global norm]
The norm is over every gradient of the model on every rank, as one process would compute it
over the whole batch's mean gradient: each rank adds up what it holds (its owned shards under
sharded gradients; everything, the same on every rank, otherwise), one all-reduce of a scalar
agrees on the total where the gradients are sharded, and every rank scales what it holds by
the same factor. Each unit's reduced gradient is reduced to its norm in the master dtype as it
is read (no master-dtype copy of every gradient at once), and under fp16 the norm is of the
unscaled gradients.

[Note: torch's clip on a prepared model]
Where a prepared model's `.grad` are not the gradients the optimizer steps on (zero2 and zero3
keep only the owned shard, so every `.grad` is None; fp16 keeps them loss-scaled), torch's
clip would return 0 or a scaled norm and clip nothing, and ported loops call it (nanoGPT's
train.py does). So while such a model is alive, `torch.nn.utils.clip_grad_norm_` is replaced
by a function that hands exactly that model's parameters to its engine's clip (the same as
`px.clip_grad_norm_`, with `error_if_nonfinite` honoured) and every other call to torch's own
function with all its arguments. The replacement is undone when the last such model is freed
and at `px.shutdown()`. A name bound before `px.prepare` (`from torch.nn.utils import
clip_grad_norm_`) keeps torch's function: call `px.clip_grad_norm_(model, max_norm)` there.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_mod
from torch.utils.weak import WeakTensorKeyDictionary

from ..world import runtime

__all__ = ["clip_units", "route_torch_clip", "restore_torch_clip"]

def clip_units(engine, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip `engine`'s reduced gradients by the global norm; returns it (see the Note)."""
    if not engine.units:
        return torch.nn.utils.clip_grad.clip_grad_norm_(
            [p for p in engine.params if p.grad is not None], max_norm, norm_type=norm_type)
    units = [u for u in engine.units if u.reduced is not None]
    device = engine.units[0].bucket.device
    dtype = engine.units[0].master_dtype
    unscale = 1.0 / engine.loss_scaler.scale if engine.loss_scaler is not None else 1.0
    norm_type = float(norm_type)
    # an offloaded gradient shard is on the host (offload.py): its norm comes to the device
    norms = [torch.linalg.vector_norm(u.reduced, norm_type, dtype=dtype).to(device)
             for u in units]
    if norm_type == float("inf"):
        local = torch.stack(norms).amax() if norms \
            else torch.zeros((), dtype=dtype, device=device)
        total = local.reshape(1) * unscale
        if engine.sharded:
            engine.comm.all_reduce(total, op="max", tag="clip_grad_norm")
    else:
        local = sum((n.pow(norm_type) for n in norms),
                    torch.zeros((), dtype=dtype, device=device))
        total = local.reshape(1)
        if engine.sharded:
            engine.comm.all_reduce(total, op="sum", tag="clip_grad_norm")
        total = total.pow(1.0 / norm_type) * unscale
    total = total.reshape(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for unit in units:
        # Under full gradients the whole bucket is scaled, so every `.grad` stays the
        # clipped mean; under sharded gradients only the owned slice exists.
        delayed = engine.delayed is not None  # the average applied: delayed.py
        target = unit.reduced if engine.shard_grads or delayed else unit.bucket.grads()
        target.mul_(coef.to(target.device, target.dtype))
    return total


# param (by identity, held weakly) -> a weak reference to its engine
_ENGINES = WeakTensorKeyDictionary()
_ORIGINAL: dict = {}  # "fn" -> torch's function while ours is installed


def _engine_of(p):
    engine = _ENGINES.get(p)
    return None if engine is None else engine()


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                     foreach=None):
    original = _ORIGINAL.get("fn", clip_mod.clip_grad_norm_)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engines = {id(e): e for e in (_engine_of(p) for p in params) if e is not None}
    if not engines:
        return original(params, max_norm, norm_type=norm_type,
                        error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    (engine,) = engines.values() if len(engines) == 1 else (None,)
    given = {id(p) for p in params}
    if engine is None or not all(id(p) in given for p in engine.params):
        raise RuntimeError(
            "torch.nn.utils.clip_grad_norm_ was given some but not all parameters of a model "
            "prepared with sharded gradients or fp16, whose gradients live in phalanx's "
            "shards; clip the whole model with px.clip_grad_norm_(model, max_norm)")
    total = engine.clip_grad_norm_(max_norm, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


_clip_grad_norm_.__doc__ = clip_mod.clip_grad_norm_.__doc__


def _engine_ended() -> None:
    if not any(engine() is not None for engine in _ENGINES.values()):
        restore_torch_clip()


def route_torch_clip(engine) -> None:
    """Route torch's clip for `engine`'s parameters to it (see the module's docstring)."""
    for p in engine.params:
        _ENGINES[p] = weakref.ref(engine)
    weakref.finalize(engine, _engine_ended)
    if "fn" not in _ORIGINAL:
        _ORIGINAL["fn"] = clip_mod.clip_grad_norm_
        clip_mod.clip_grad_norm_ = _clip_grad_norm_
        nn_utils.clip_grad_norm_ = _clip_grad_norm_


def restore_torch_clip() -> None:
    """Put torch's own function back (no model needs ours any more, or px.shutdown)."""
    original = _ORIGINAL.pop("fn", None)
    if original is not None:
        clip_mod.clip_grad_norm_ = original
        nn_utils.clip_grad_norm_ = original
    _ENGINES.clear()


runtime.before_shutdown(restore_torch_clip)
