"""The module `px.prepare` returns: the user's model plus what happens around each forward.

Around the user's forward it keeps buffers equal across ranks (rank 0's, broadcast before each
training forward, unless `broadcast_buffers=False`), casts floating inputs to the compute dtype
and floating outputs back to fp32 under mixed precision, and under fp16 routes outputs through
the loss scaler's gradient multiplier. Everything else (hooks, buckets, the optimizer) belongs
to the strategy object it holds as `_engine`.

Its `state_dict()` is the user's module's, without a `module.` prefix, so checkpoints move
freely between prepared and plain models.
"""

from __future__ import annotations

import dataclasses

import torch

from .consistency import broadcast_tensors

__all__ = ["PreparedModule", "map_tensors"]


def map_tensors(fn, obj):
    """Apply `fn` to every tensor in a nest of tuples, lists, dicts and dataclass-like outputs."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, dict):
        mapped = {k: map_tensors(fn, v) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        try:
            return type(obj)(**mapped)  # output classes built from their fields
        except TypeError:
            out = type(obj)()
            out.update(mapped)
            return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(fn, getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _tensors_in(obj):
    """Every tensor in such a nest, without rebuilding anything (for hooks on outputs whose
    type cannot be rebuilt from its fields)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name))


class PreparedModule(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, engine, group, *, broadcast_buffers: bool = True,
                 compute_dtype: torch.dtype = torch.float32, loss_scaler=None):
        super().__init__()
        self.module = module
        self._engine = engine
        self._group = group
        self._broadcast_buffers = broadcast_buffers and group is not None
        self._compute_dtype = compute_dtype
        self._loss_scaler = loss_scaler
        self._buffers_to_sync = [b for b in module.buffers()] if self._broadcast_buffers else []
        self._trainable = [p for p in module.parameters() if p.requires_grad]

    def _check_trainable(self) -> None:
        """Freezing or unfreezing after prepare would silently desynchronise the ranks (a newly
        trainable parameter has no hook, so its gradient is never averaged): refuse it."""
        now = [p for p in self.module.parameters() if p.requires_grad]
        if len(now) != len(self._trainable) or any(a is not b for a, b in zip(now, self._trainable)):
            raise RuntimeError(
                "the set of trainable parameters changed after px.prepare (requires_grad was "
                "switched, or parameters were added); freeze or unfreeze before px.prepare, or "
                "prepare a new model")

    def forward(self, *args, **kwargs):
        if self._engine is not None and self.training and torch.is_grad_enabled():
            self._check_trainable()
        if self.training and self._buffers_to_sync:
            broadcast_tensors(self._buffers_to_sync, self._group)
        low = self._compute_dtype != torch.float32
        if low:
            cast_in = lambda t: t.to(self._compute_dtype) if t.is_floating_point() else t  # noqa: E731
            args, kwargs = map_tensors(cast_in, args), map_tensors(cast_in, kwargs)
        out = self.module(*args, **kwargs)
        if low:
            out = map_tensors(lambda t: t.float() if t.is_floating_point() else t, out)
        if torch.is_grad_enabled() and (self._engine is not None or self._loss_scaler is not None):
            for t in _tensors_in(out):
                self._hook_output(t)
        return out

    def _hook_output(self, t: torch.Tensor) -> None:
        """Register the gradient hook that marks the start of backward on each output.

        See [Note: the end of the outermost backward] in reducer.py. Under fp16 the same hook
        multiplies the incoming gradient by the loss scale (see loss_scaling.py).
        """
        if not (t.requires_grad and t.is_floating_point()):
            return
        reducer = self._engine.reducer if self._engine is not None else None
        scaler = self._loss_scaler

        def on_output_grad(grad):
            if reducer is not None:
                reducer.backward_started()
            return grad * scaler.scale if scaler is not None else None

        t.register_hook(on_output_grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        clear = getattr(self._engine, "clear_reduced", None)
        if clear is not None:
            clear()

    def no_sync(self):
        """Same as `px.no_sync(model)`, under the name PyTorch's DDP users reach for."""
        from .prepare import no_sync

        return no_sync(self)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace parameters that phalanx "
                             "holds in its buffers; load with assign=False (the default)")
        result = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        refresh = getattr(self._engine, "params_changed", None)
        if refresh is not None:
            refresh()
        return result
