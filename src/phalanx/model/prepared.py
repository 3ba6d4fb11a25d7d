"""The module `px.prepare` returns: the user's model plus what happens around each forward.

Around the user's forward it moves the inputs to the model's device (as torch DDP does with
`device_ids`: tensors anywhere in the arguments, nested in tuples, lists, dicts and dataclasses,
without blocking the host; `px.data_loader` pins its batches on a GPU machine so the copy is
asynchronous), applies the precision policy
(model/precision.py: inputs to the compute dtype, the forward under autocast to it, outputs to
fp32), and returns every floating output through the output node of model/loss_scaling.py, which
tells the engine that backward started and, under fp16, scales the gradient exactly once. Everything
else (hooks, buckets, the optimizer) belongs to the engine it holds, called through the `Engine`
protocol (engine/__init__.py).

Buffers are kept equal to rank 0's by the engine, at the end of each backward that
synchronises, unless `broadcast_buffers=False` (see [Note: buffers as torch DDP keeps them] in
model/buffers.py): a forward makes no collective for them, so a rank that evaluates under
`torch.no_grad()` waits for nobody, with the statistics every rank has.

`state_dict()` is the user's module's, without a `module.` prefix, and so is
`px.unwrap(model).state_dict()`: the user's module answers through a state_dict hook with what
one process would hold, in the dtypes the model had before prepare. Under bf16/fp16 the
trainable parameters are the fp32 masters' values; under zero3 (whose parameters, frozen ones
included, exist only while their unit computes) and wherever masters are sharded, the shards
this rank does not hold are read from the peers one unit at a time onto the CPU, without their
taking part
([Note: reading a peer's shards] in engine/remote.py), so one rank may call it alone (nanoGPT
saves `raw_model.state_dict()` inside `if master_process:`). Frozen parameters and cast buffers
are widened back. With `keep_vars=True` the live tensors are returned as torch returns them.

[Note: the prepared model's names]
The prepared model names its parameters and buffers as the user's module does, in
`state_dict()`, `named_parameters()` and `named_buffers()` alike (torch DDP prefixes them all
with `module.`). torch's distributed checkpoint functions (`get_model_state_dict`,
`get_optimizer_state_dict`, `set_*`: torch.distributed.checkpoint.state_dict) key the model's
state by `state_dict()`'s names and the optimizer's by `named_parameters()`'s, and walk the
modules, where `_fqn_modifiers` (their hook for a wrapper that adds no level) skips the child
`module`; so both carry the names an FSDP2 or single-process checkpoint has.

`load_state_dict()` likewise, through the prepared model or through `px.unwrap(model)` (as
Accelerate's `unwrap_model(model).load_state_dict(sd)`): load hooks on the user's module set
the masters from the given values exactly (under bf16 the parameters torch writes hold them
rounded to bf16; the fp32 masters keep every bit), so nothing is lost in a save and load. Under
zero3 the parameters are given storage for torch to write and freed after; each rank keeps its
slices of the values, with no collective.
"""

from __future__ import annotations

import time
import weakref

import torch

from .._tree import map_tensors, to_device
from ..comm import continuation
from .loss_scaling import OutputNode
from .sync_batchnorm import SyncBatchNorm

__all__ = ["PreparedModule"]


class PreparedModule(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, engine, comm, precision, *,
                 original_dtypes: dict | None = None,
                 clock=None, device: torch.device | None = None, outer=None, build=None,
                 optimizer=None):
        super().__init__()
        self._clock = clock  # the step report's StepClock (observe/step_report.py), or None
        self._diloco = outer  # DiLoCo's outer step, a part (engine/part.py), or None
        self._build = build  # builds the engine again for another layout (relayout.py)
        # the optimizer prepared with it (relayout.py), weakly: the model must not keep it
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self.module = module
        self._engine = engine
        self._comm = comm
        self._precision = precision
        self._trainable = [p for p in module.parameters() if p.requires_grad]
        self._storage = [self._where(p) for p in self._trainable]
        self._original_dtypes = original_dtypes or {}  # by the uncompiled module's names
        self._device = device
        self._device_type = device.type if device is not None else \
            next((t.device.type for t in module.parameters()), "cpu")
        # See the module docstring: the user's module (inside a module compiled before
        # prepare) answers state_dict() with full values. A weak reference: the user's module
        # must not keep the engine alive.
        compiled = type(module).__name__ == "OptimizedModule"
        user = module._modules["_orig_mod"] if compiled else module
        mine = weakref.ref(self)

        def full_state(m, sd, prefix, _meta):
            prepared = mine()
            if prepared is not None:
                prepared._full_state(m, sd, prefix)

        def before_load(m, sd, prefix, metadata, *_):
            prepared = mine()
            if prepared is not None:
                prepared._before_load(m, sd, prefix, metadata)

        def after_load(m, _incompatible):
            prepared = mine()
            if prepared is not None:
                prepared._after_load()
        user.register_state_dict_post_hook(full_state)
        user.register_load_state_dict_pre_hook(before_load)
        user.register_load_state_dict_post_hook(after_load)
        self._loading = None  # (values, units opened) between the two load hooks
        if any(isinstance(m, (SyncBatchNorm, torch.nn.SyncBatchNorm)) for m in module.modules()):
            engine.vote.unavailable = ("the model's SyncBatchNorm layers make collectives of "
                                       "their own in the forward and backward")
        remote = engine.remote
        if remote is not None:  # see [Note: a model dropped while a peer reads it] in remote.py
            weakref.finalize(self, remote.retire, engine.remote_id)
            remote.open(engine.remote_id)  # [Note: served once prepared] in remote.py

    def _parts(self) -> list:
        """The features beside the strategy whose state a checkpoint keeps: the engine's parts,
        then DiLoCo's outer step (engine/part.py)."""
        return [*self._engine.parts(), *([self._diloco] if self._diloco is not None else [])]

    def _use_engine(self, engine) -> None:
        """Run on `engine` from now on (relayout.py: the engine built again for another
        layout): the parameters' places are the new engine's."""
        self._engine = engine
        self._storage = [self._where(p) for p in self._trainable]

    def _where(self, p):
        """The address of a parameter's values; under zero3, whose units' storage is freed and
        allocated again between uses (the address moves), the storage object itself."""
        return p.untyped_storage()._cdata if self._engine.reshards else p.data_ptr()

    def _check_trainable(self) -> None:
        """Freezing or unfreezing after prepare would silently desynchronise the ranks (a newly
        trainable parameter has no hook, so its gradient is never averaged), and a parameter
        given new storage (`p.data = ...`) is no longer the one phalanx averages: refuse both."""
        now = [p for p in self.module.parameters() if p.requires_grad]
        if len(now) != len(self._trainable) or \
                any(a is not b for a, b in zip(now, self._trainable)):
            raise RuntimeError(
                "the set of trainable parameters changed after px.prepare (requires_grad was "
                "switched, or a parameter was added or replaced); freeze or unfreeze before "
                "px.prepare, load new values with model.load_state_dict, or prepare a new model")
        if any(self._where(p) != where for p, where in zip(now, self._storage)):
            raise RuntimeError(
                "a parameter was given new storage after px.prepare (`param.data = ...` or a "
                "module re-created); change values in place (`with torch.no_grad(): "
                "param.copy_(...)`, or model.load_state_dict) so phalanx keeps averaging it")

    def forward(self, *args, **kwargs):
        began = time.perf_counter()
        grad = torch.is_grad_enabled()
        if grad:
            continuation.now().iteration_starts()  # after a recovery, training goes on here
        self._engine.before_forward(grad)
        if grad:
            self._check_trainable()
        try:
            return self._forward(began, grad, args, kwargs)
        except Exception as exc:  # the other ranks are in this step: see engine/vote.py
            if grad:
                self._engine.forward_raised(exc)
            raise

    def _forward(self, began: float, grad: bool, args, kwargs):
        if self._device is not None and self._device.type != "cpu":
            args, kwargs = to_device((args, kwargs), self._device)
        precision = self._precision
        if precision.low:
            args, kwargs = map_tensors(precision.cast_input, (args, kwargs))
        with precision.compute(self._device_type):
            out = self.module(*args, **kwargs)
        clock = self._clock
        if grad:
            engine, scaler = self._engine, precision.loss_scaler
            if clock is None:
                on_grad = engine.backward_started
            else:
                clock.forward_done(began, args, kwargs)

                def on_grad(g, engine=engine, clock=clock):
                    engine.backward_started(g)
                    clock.backward_started()

            def through_node(t):
                t = precision.cast_output(t)
                if t.requires_grad and t.is_floating_point():
                    return OutputNode.apply(t, on_grad, scaler)
                return t
            return map_tensors(through_node, out)
        if precision.low:
            out = map_tensors(precision.cast_output, out)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._engine.zero_grad(set_to_none)

    def no_sync(self):
        """Same as `px.no_sync(model)`, under the name PyTorch's DDP users reach for."""
        return self._engine.no_sync()

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch for accumulation micro-steps (False: communicate nothing)."""
        return self._engine.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._engine.require_backward_grad_sync = value

    @property
    def loss_scaler(self):
        """fp16's `DynamicLossScaler` (a Stateful: save and load its state_dict), else None."""
        return self._precision.loss_scaler

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """The user's module's, under the names its state_dict has (no `module.` prefix): see
        [Note: the prepared model's names]."""
        if not recurse:  # the prepared model has no parameters of its own
            return iter(())
        return self.module.named_parameters(prefix=prefix, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):
        """The user's module's, as `named_parameters`."""
        if not recurse:
            return iter(())
        return self.module.named_buffers(prefix=prefix, remove_duplicate=remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch's distributed checkpoint functions (torch.distributed.checkpoint.
        state_dict): the child `module` adds no level to the names (see the Note)."""
        return {"module": "module"}

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The user's module's state, as one process would hold it (see the module docstring);
        no collective: one rank may call it alone."""
        return self.module.state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)

    @torch.no_grad()
    def _full_state(self, module, sd, prefix: str) -> None:
        """The state_dict hook on the user's module (see the module docstring)."""
        named = list(module.named_parameters(remove_duplicate=False))
        if any(sd.get(prefix + name) is p for name, p in named):
            return  # keep_vars=True: the live tensors, as torch gives them
        engine = self._engine
        engine.vote.check_stepped()  # [Note: a step that raised in the optimizer] (engine/)
        values = engine.full_master_values() if engine.reshards or self._precision.low else {}
        for name, p in named:
            value = values.get(id(p))
            if value is not None and prefix + name in sd:
                sd[prefix + name] = value
        for name, dtype in self._original_dtypes.items():
            value = sd.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                sd[prefix + name] = value.to(dtype)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The user's module's load, whose hooks set the masters (see the module docstring)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _before_load(self, module, state_dict, prefix: str, metadata: dict) -> None:
        """The load pre-hook on the user's module: note the loaded values of the parameters
        (the engine takes those it holds: the trainable ones' masters, and under zero3 the
        frozen ones' shards), and under zero3 give the parameters storage to be written."""
        if metadata.get("assign_to_params_buffers"):
            raise ValueError("load_state_dict(assign=True) would replace parameters that phalanx "
                             "holds in its buffers; load with assign=False (the default)")
        values = {}
        for name, p in module.named_parameters():
            value = state_dict.get(prefix + name)
            # a value of another shape is torch's to refuse, with its own message
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                values[id(p)] = value
        self._loading = (values, self._engine.open_params())

    def _after_load(self) -> None:
        """The load post-hook: the masters take the loaded values exactly (the parameters,
        written by torch in the compute dtype, hold them rounded), and zero3 frees again."""
        loading, self._loading = self._loading, None
        if loading is None:
            return
        values, opened = loading
        try:
            self._engine.load_masters(values)
        finally:
            self._engine.close_params(opened)
