"""`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on a prepared model: the truth.

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

from .. import runtime

__all__ = ["route_torch_clip", "restore_torch_clip"]

# id(param) -> (weakref to the param, weakref to its engine). Not a WeakKeyDictionary: tensors
# compare element-wise, so a dictionary keyed by them cannot tell two apart safely.
_ENGINES: dict[int, tuple] = {}
_ORIGINAL: dict = {}  # "fn" -> torch's function while ours is installed


def _engine_of(p):
    entry = _ENGINES.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


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


def _forget(key: int) -> None:
    _ENGINES.pop(key, None)
    if not any(entry[1]() is not None for entry in _ENGINES.values()):
        restore_torch_clip()


def route_torch_clip(engine) -> None:
    """Route torch's clip for `engine`'s parameters to it (see the module's docstring)."""
    for p in engine.params:
        _ENGINES[id(p)] = (weakref.ref(p), weakref.ref(engine))
    keys = [id(p) for p in engine.params]
    weakref.finalize(engine, lambda: [_forget(k) for k in keys])
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
