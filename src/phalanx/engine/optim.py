"""Adopting the user's optimizer: it steps the master pieces of this rank's shards.

The optimizer keeps its class, hyper-parameters and param groups; what it steps are the master
pieces (flat.py: one piece per parameter overlapping the owned slice), and `step`, `zero_grad`,
`state_dict` and `load_state_dict` are routed through the engine, as instance attributes so the
class stays the user's. That is done only when masters differ from the parameters (sharded
optimizer state or low-precision compute); under fp32 ddp the optimizer is left exactly as
built.

[Note: the param groups hold the user's parameters between steps]
`optimizer.param_groups` hold the parameters the user built them over, as in one process, and
hold the master pieces only while the optimizer steps or loads its own state
(`holding_masters`). Tools that map an optimizer's parameters to the model's by identity see
the model's: torch's distributed checkpoint functions (`get_optimizer_state_dict` keys the state
by the names of `model.named_parameters()` found in the param groups, and raised KeyError with
the masters there), a clip over the optimizer's parameters, a name per learning rate in a log.
The optimizer's state (`optimizer.state`) stays keyed by the master pieces.

Sharding the optimizer is exact for optimizers whose update of each element depends only on
that element's gradient, its own state and the group's hyper-parameters; an optimizer that
needs some parameters whole (Muon, Adafactor) steps each of those on one owner rank instead
(owners.py); any other is refused rather than silently stepped differently
(optimizer_kinds.py). What the optimizer steps and keys its state by is a *holder* (`Held`):
a master piece, or an owner's whole parameter.

[Note: the optimizer's state_dict]
`optimizer.state_dict()` has the format of a single process: state keyed by the position of
each parameter in the param groups as the user built them, tensors of the parameter's shape.
Where each rank holds the whole state (ddp, any precision) that is this rank's own. Where the
state is sharded (zero1, zero2, zero3), `optimizer.state_dict()` is typically called on one rank
only (nanoGPT saves inside `if master_process:`), so that rank reads the other ranks' shares
one-sidedly, while they go on ([Note: reading a peer's shards] in remote.py);
`px.optimizer_state_dict(optimizer)`, which every rank calls, gathers them in one collective
instead. `optimizer.load_state_dict()` takes the single-process format under every strategy,
precision and world size: each rank keeps the slices of its pieces. State already in the
optimizer when it is prepared (loaded from a checkpoint before `px.prepare`, the order nanoGPT
resumes in) is taken over the same way.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import flat as flat_layout
from .optimizer_kinds import block_size, check_declared
from .rounding import ROUNDINGS, Compensation, fp32_step

__all__ = ["OptimizerAdapter", "Held", "optimizer_state_dict", "adapter_of", "held_groups",
           "native_load_state_dict", "per_element", "plain"]


@dataclass(frozen=True, eq=False)
class Held:
    """A tensor the adopted optimizer steps and keys its state by (`tensor`: a master piece,
    or an owner's whole parameter, owners.py), standing for the elements [start, end) of the
    flattened `param`; per-element state has `shape`."""
    param: torch.Tensor
    start: int
    end: int
    tensor: torch.Tensor
    shape: torch.Size

# The adapter lives on the optimizer it adopts (an attribute, not a global table: a table keyed
# weakly by the optimizer would still keep it alive through the adapter, which refers to it).
_ADAPTER_ATTR = "_phalanx_adapter"


def adapter_of(optimizer) -> "OptimizerAdapter | None":
    return getattr(optimizer, _ADAPTER_ATTR, None)


def plain(value):
    """A state tensor as plain values: a quantized one (torchao's low-bit state, a tensor
    subclass with `dequantize()`) dequantized, anything else as it is."""
    if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor \
            and not isinstance(value, torch.nn.Parameter) and hasattr(value, "dequantize"):
        return value.dequantize()
    return value


def per_element(key: str, value, shape) -> bool:
    """Whether an optimizer state entry holds one value per element of a parameter of `shape`
    (Adam's moments, a momentum buffer), rather than one for the whole tensor (a step count):
    the former is split and joined with the parameter, the latter kept whole."""
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == shape


def optimizer_groups(optimizer, module) -> dict:
    """Map each trainable parameter the optimizer holds to its param group index, refusing
    parameters that are not the model's: an optimizer built over another model's parameters,
    or a copy's, would step tensors that data parallelism never averages. Frozen parameters
    of the model may be in the optimizer (it skips them, having no gradient)."""
    model_params = {id(p) for p in module.parameters()}
    group_of = {}
    for g, param_group in enumerate(optimizer.param_groups):
        for p in param_group["params"]:
            if id(p) not in model_params:
                raise ValueError(
                    "the optimizer holds a parameter that is not a parameter of the model; "
                    "build the optimizer over model.parameters() of the model you prepare")
            if p.requires_grad:
                group_of[p] = g
    return group_of


class OptimizerAdapter:
    def __init__(self, optimizer, engine, module):
        self.optimizer = optimizer
        self.engine = engine
        group_of = optimizer_groups(optimizer, module)
        self.adopted = engine.adopt
        self.after_step: list = []  # called after each optimizer.step() (engine.watch_steps)
        self.before_step = None     # fn() -> whether the step may run (engine.guard_steps)
        # The groups as the user built them: what a single process's state_dict indexes.
        self.original = [list(g["params"]) for g in optimizer.param_groups]
        setattr(optimizer, _ADAPTER_ATTR, self)
        # a step that raised on this rank is voted down before a step (vote.py), and a step
        # that raised in the optimizer is seen (vote.py's [Note: a step that raised in the
        # optimizer]): the adopted step does both itself
        if not self.adopted:
            self._user = {"step": optimizer.step}
            optimizer.step = types.MethodType(_watched(engine.vote, optimizer.step), optimizer)
            return
        check_declared(optimizer)
        # a state loaded before prepare, in the single-process format (see the Note)
        loaded = optimizer.state_dict() if _has_stepped(optimizer) else None
        missing = [p for p in engine.params if p not in group_of]
        if missing:
            muon = hasattr(torch.optim, "Muon") and isinstance(optimizer, torch.optim.Muon)
            raise ValueError(
                f"{len(missing)} trainable parameter(s) of the model are not in the optimizer; "
                "add them, or set requires_grad=False on the ones you do not train"
                + ("; torch.optim.Muon takes matrices only: chain it with an optimizer over "
                   "the rest, px.prepare(model, px.chain_optimizers(muon, adamw)), or declare "
                   "one class of your own holding both groups with px.matrix_wise(cls, "
                   "whole=lambda group, p: group['use_muon'])"
                   if muon else ""))
        # what the optimizer steps: the master pieces, but for a parameter stepped whole on
        # its owner (owners.py), the owner's whole tensor, and nothing on the other ranks
        wholes = engine.wholes
        holders = []
        for unit in engine.units:
            for piece in unit.pieces:
                p = unit.params[piece.param_index]
                if wholes is None or wholes.of(p) is None:
                    holders.append(Held(p, piece.start, piece.end, piece.master,
                                        piece.master.shape))
        for w in wholes.owned() if wholes is not None else []:
            holders.append(Held(w.param, 0, w.numel, w.tensor, w.param.shape))
        self.holders_of: dict[int, list[Held]] = {}
        for h in holders:
            self.holders_of.setdefault(id(h.param), []).append(h)
        # what each group steps: see [Note: the param groups hold the user's parameters ...]
        self.held = [[h.tensor for h in holders if group_of[h.param] == g]
                     for g in range(len(optimizer.param_groups))]
        self._unit_groups: dict[int, list] = {}  # step_unit's, by unit index
        with self.holding_masters():
            _init_state_for_masters(optimizer)
        self.blocks = block_size(optimizer)
        if self.blocks is not None and engine.sharded:
            self._quantize_by_parameter()
        # Plain functions bound to the optimizer rather than this object's methods: an LR
        # scheduler created later re-binds `step.__func__` to the optimizer, which must still
        # land here.
        self._user = {name: getattr(optimizer, name)
                      for name in ("step", "zero_grad", "state_dict", "load_state_dict")}
        adapter = self
        # bf16-true: each call steps in fp32 and rounds back ([Note: bf16-true's step])
        self.rounding = getattr(engine.precision, "rounding", None)
        self.compensation = None  # the "kahan" rounding's buffers (rounding.py; measured only)
        self.position_of = {id(p): i for i, p in
                            enumerate(q for group in self.original for q in group)}

        def step(opt, closure=None):
            return adapter.step(closure)
        # An LR scheduler built before px.prepare wrapped the step it found and marked it;
        # without the mark, every scheduler.step() warns that optimizer.step() was overridden
        # after the scheduler was built. The wrapper it made is `self._user["step"]`, which
        # each step calls (and which notes that the optimizer stepped), so the mark is true.
        if getattr(self._user["step"], "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True
        optimizer.step = types.MethodType(step, optimizer)
        optimizer.zero_grad = types.MethodType(
            lambda opt, set_to_none=True: adapter.zero_grad(set_to_none), optimizer)
        optimizer.state_dict = types.MethodType(lambda opt: adapter.state_dict(), optimizer)
        optimizer.load_state_dict = types.MethodType(
            lambda opt, state_dict: adapter.load_state_dict(state_dict), optimizer)
        if loaded is not None:
            self.load_state_dict(loaded)

    def holding_masters(self):
        """The param groups hold the master pieces for the duration (see the Note)."""
        return self._holding(self.held)

    @contextmanager
    def _holding(self, lists: list[list]):
        """The param groups hold `lists` (one list of tensors per group) for the duration,
        then what they held before."""
        groups = self.optimizer.param_groups
        shown = [group["params"] for group in groups]
        for group, tensors in zip(groups, lists):
            group["params"] = tensors
        try:
            yield
        finally:  # on the groups there now: torch's own load_state_dict makes new ones
            for group, params in zip(self.optimizer.param_groups, shown):
                group["params"] = params

    def step_unit(self, unit) -> None:
        """The optimizer's own step over `unit`'s holders alone: its param groups hold only
        those for the call ([Note: the step in backward] in stepping.py)."""
        lists = self._unit_groups.get(unit.index)
        if lists is None:  # once per unit: its holders, group by group
            mine = {id(h.tensor) for p in unit.params for h in self.holders_of.get(id(p), [])}
            lists = self._unit_groups[unit.index] = [[t for t in held if id(t) in mine]
                                                     for held in self.held]
        with self._holding(lists):
            self._own_step()

    def _own_step(self):
        """The optimizer's own step, once (a run of units, or one unit); under bf16-true in
        fp32, rounded back ([Note: bf16-true's step] in rounding.py)."""
        if self.rounding is None:
            return self._user["step"]()
        active = [h for h in self.holders() if h.tensor.grad is not None]
        # an fp32 copy of a cap's worth at a time ([Note: a cap on a piece] in flat.py)
        for batch in _batches(active, flat_layout.PIECE_CAP):
            with self._holding_only(batch), \
                    fp32_step(batch, self.optimizer, self.position_of, self.engine.steps.value,
                              self.rounding, self.compensation):
                self._user["step"]()
        return None

    def _holding_only(self, holders):
        """The param groups hold only `holders`' tensors of what they hold now, for the
        duration (one call of the optimizer's own step over them)."""
        ids = {id(h.tensor) for h in holders}
        return self._holding([[t for t in group["params"] if id(t) in ids]
                              for group in self.optimizer.param_groups])

    def round_by(self, rounding: str) -> None:
        """bf16-true: how the fp32 step rounds back, one of rounding.py's ROUNDINGS (a
        measurement's switch: benchmarks/bf16_true.py; px.prepare uses "stochastic")."""
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding={rounding!r}: one of {', '.join(ROUNDINGS)}")
        self.rounding = rounding
        self.compensation = Compensation() if rounding == "kahan" else None

    def release(self) -> None:
        """Give the optimizer back as the user built it: its groups' parameters, its own
        methods, no state (an engine rebuilt for another layout adopts it again and loads its
        state: continuing/, model/relayout.py)."""
        optimizer = self.optimizer
        for name, method in self._user.items():
            optimizer.__dict__[name] = method
        if self.adopted:
            for group, params in zip(optimizer.param_groups, self.original):
                group["params"] = list(params)
            optimizer.state.clear()
        optimizer.__dict__.pop(_ADAPTER_ATTR, None)

    # -- step -----------------------------------------------------------------------------
    def _as_built(self) -> bool:
        """Whether the param groups hold the parameters they held at px.prepare, no more."""
        groups = self.optimizer.param_groups
        return len(groups) == len(self.original) and all(
            len(g["params"]) == len(built) and all(p is q for p, q in zip(g["params"], built))
            for g, built in zip(groups, self.original))

    def step(self, closure=None):
        if not self._as_built():
            raise RuntimeError(
                "the optimizer holds a parameter or param group added after px.prepare (or its "
                "groups' parameters were replaced); add every parameter to the optimizer before "
                "calling px.prepare")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        vote = self.engine.vote
        vote.catch_up()
        if vote.dropped:  # see [Note: the step vote] in vote.py: nothing, anywhere
            return loss
        if self.engine.stepped_in_backward:  # [Note: the step in backward] in stepping.py
            self.engine.stepped_in_backward = False
            for fn in self.after_step:
                fn()
            return loss
        if self.before_step is not None and not self.before_step():
            self.engine.drop_grads()  # the step is thrown away: it changes nothing
        # see [Note: a step that raised in the optimizer] in vote.py
        with vote.stepping(), self.holding_masters():
            stepped = self.engine.step_units(self._own_step)
        if not stepped and self.engine.loss_scaler is not None:
            self.zero_grad()  # overflowed gradients are of no use to a later step
        for fn in self.after_step:
            fn()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._user["zero_grad"](set_to_none=set_to_none)
        self.engine.zero_grad(set_to_none)
        for p in self.engine.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()

    # -- state_dict ---------------------------------------------------------------------------
    def local_parts(self) -> dict[int, list]:
        """position (single-process index) -> [(start, end, {key: value})] for this rank."""
        parts: dict[int, list] = {}
        state = self.optimizer.state
        for index, p in enumerate(q for group in self.original for q in group):
            for held in self.holders_of.get(id(p), []):
                s = state.get(held.tensor)
                if not s:
                    continue
                entry = {}
                for key, value in s.items():
                    value = plain(value)
                    entry[key] = ("elements", value.detach().reshape(-1).clone()) \
                        if per_element(key, value, held.shape) \
                        else ("whole", value.clone() if isinstance(value, torch.Tensor) else value)
                parts.setdefault(index, []).append((held.start, held.end, entry))
        return parts

    def holders(self) -> list[Held]:
        """Every holder this rank's optimizer steps (see the module's docstring)."""
        return [h for hs in self.holders_of.values() for h in hs]

    def _assemble(self, all_parts: list[dict]) -> dict:
        params = [q for group in self.original for q in group]
        state = {}
        for index, p in enumerate(params):
            pieces = [piece for parts in all_parts for piece in parts.get(index, [])]
            if not pieces:
                continue
            out = {}
            for key in pieces[0][2]:
                kind, value = pieces[0][2][key]
                if kind == "whole":
                    out[key] = value
                    continue
                full = torch.zeros(p.numel(), dtype=value.dtype, device=value.device)
                for start, end, entry in pieces:
                    full[start:end].copy_(entry[key][1].to(full.device))
                out[key] = full.view(p.shape)
            state[index] = out
        groups = []
        with self.holding_masters():  # the state is keyed by the masters
            user_groups = self._user["state_dict"]()["param_groups"]
        position = 0
        for g, group in enumerate(self.original):
            groups.append({**user_groups[g],
                           "params": list(range(position, position + len(group)))})
            position += len(group)
        return {"state": state, "param_groups": groups}

    def state_dict(self) -> dict:
        """See [Note: the optimizer's state_dict]."""
        if self.engine.sharded:  # the peers' shares read one-sidedly (engine/remote.py)
            return self._assemble(self.engine.peer_optimizer_parts())
        return self._assemble([self.local_parts()])

    def full_state_dict(self) -> dict:
        """The single-process state on every rank; a collective under sharding."""
        if not self.adopted:
            return self.optimizer.state_dict()
        local = self.local_parts()
        if not self.engine.sharded:
            return self._assemble([local])
        return self._assemble(self.engine.comm.all_gather_object(local, tag="optimizer state"))

    def native_load(self, state_dict: dict) -> None:
        """The optimizer's own `load_state_dict`, over the master pieces (see
        `native_load_state_dict`)."""
        with self.holding_masters():
            self._user["load_state_dict"](state_dict)
        self._requantize()

    # -- state in blocks ------------------------------------------------------------------------
    def _quantize_by_parameter(self) -> None:
        """[Note: state in blocks]
        torchao's low-bit optimizers quantize a tensor's state in blocks of `block_size`
        consecutive elements (one scale each), and only a tensor of at least 4096 elements
        that is a whole number of blocks; others keep fp32 state. Under sharding the tensor
        the optimizer sees is a piece of a parameter: the units put every shard boundary on a
        block boundary of the parameters it cuts (buckets.py's `align`), so a piece's blocks
        are the parameter's, and the decision is taken for the parameter, not the piece (the
        optimizer's own `_new_buffer`, asked of this instance), so each element's state is
        quantized with the same block, scale and code as in one process
        (tests/test_low_bit_optimizers.py)."""
        optimizer, blocks = self.optimizer, self.blocks
        param_of = {id(h.tensor): h.param for h in self.holders()}

        def new_buffer(p, signed):
            param = param_of.get(id(p), p)
            if param.numel() >= 4096 and param.numel() % blocks == 0 and p.numel() % blocks == 0:
                return optimizer._subclass_zeros(p, signed, blocks).to(p.device)
            return torch.zeros_like(p)
        optimizer._new_buffer = new_buffer

    def _requantize(self) -> None:
        """After a load: state that torch's load_state_dict left as plain tensors where the
        optimizer keeps it quantized, quantized again (its own copy_ into a fresh buffer)."""
        if self.blocks is None or not self.engine.sharded:
            return
        signed = {"exp_avg": True}
        for held in self.holders():
            state = self.optimizer.state.get(held.tensor)
            for key, value in list((state or {}).items()):
                if type(value) is torch.Tensor and per_element(key, value, held.shape) \
                        and key != "step":
                    fresh = self.optimizer._new_buffer(held.tensor, signed.get(key, False))
                    if type(fresh) is not torch.Tensor:
                        fresh.copy_(value)
                        state[key] = fresh

    def load_state_dict(self, state_dict: dict) -> None:
        """The single-process format; each saved group's "params" names its parameters in the
        order this optimizer's group holds them, by position (0 .. n-1, or the names torch's
        distributed checkpoint functions give them), as torch's own load matches them."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.original):
            raise ValueError(f"the saved optimizer state has {len(saved_groups)} param groups, "
                             f"this optimizer {len(self.original)}")
        for saved, built in zip(saved_groups, self.original):
            if len(saved["params"]) != len(built):
                raise ValueError(f"a saved param group has {len(saved['params'])} parameters, "
                                 f"this optimizer's {len(built)}")
        saved_ids = [key for group in saved_groups for key in group["params"]]
        params = [q for group in self.original for q in group]
        saved_state = state_dict["state"]
        if saved_state and all(isinstance(s, dict) and not s for s in saved_state.values()):
            # torch's set_optimizer_state_dict(..., flatten_optimizer_state_dict=True) rebuilds
            # each parameter's entry from the names in optimizer.state[param], and this
            # optimizer's state is keyed by its master pieces (see the Note at the top): every
            # entry comes empty, and loading it would keep none of the saved state
            raise ValueError(
                "optimizer.load_state_dict: every parameter's entry of this state dict is empty, "
                "as torch's set_optimizer_state_dict makes it from a flattened state dict "
                "(StateDictOptions(flatten_optimizer_state_dict=True)) for an optimizer whose "
                "state phalanx keeps on the master copies (zero1/zero2/zero3, mixed precision); "
                "nothing would be loaded. Use the unflattened form (the default options) or "
                "px.load")
        state, groups, position = {}, [], 0
        position_of = {id(m): i for i, m in enumerate(m for g in self.held for m in g)}
        for index, p in enumerate(params):
            saved_id = saved_ids[index]
            s = saved_state.get(saved_id, saved_state.get(str(saved_id)))
            if s is None:
                continue
            for held in self.holders_of.get(id(p), []):
                entry = {}
                for key, value in s.items():
                    if per_element(key, value, p.shape):
                        value = value.reshape(-1)[held.start:held.end].view(held.shape)
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                state[position_of[id(held.tensor)]] = entry
        for g, held in enumerate(self.held):
            groups.append({**{k: v for k, v in saved_groups[g].items() if k != "params"},
                           "params": list(range(position, position + len(held)))})
            position += len(held)
        with self.holding_masters():
            self._user["load_state_dict"]({"state": state, "param_groups": groups})
        self._requantize()


def _batches(holders: list, cap: int) -> list[list]:
    """`holders` in consecutive batches of at most `cap` elements (a longer one alone)."""
    out, batch, size = [], [], 0
    for h in holders:
        n = h.end - h.start
        if batch and size + n > cap:
            out.append(batch)
            batch, size = [], 0
        batch.append(h)
        size += n
    return out + [batch] if batch else out


def _watched(vote, user_step):
    """An optimizer's own step (ddp at full precision: not adopted) as the vote watches it:
    first what the vote makes up, then the step, seen to return ([Note: a step that raised in
    the optimizer] in vote.py). The step is torch's with its hooks, so a pre-hook that raises
    is inside it. A scheduler built before px.prepare keeps its mark (see the adopted step)."""
    def step(opt, *args, **kwargs):
        vote.catch_up()
        with vote.stepping():
            return user_step(*args, **kwargs)
    if getattr(user_step, "_wrapped_by_lr_sched", False):
        step._wrapped_by_lr_sched = True
    return step


def held_groups(optimizer) -> list[list[torch.Tensor]]:
    """The tensors each param group steps: the master pieces once adopted (see [Note: the param
    groups hold the user's parameters between steps]), else the parameters."""
    adapter = adapter_of(optimizer)
    if adapter is None or not adapter.adopted:
        return [list(g["params"]) for g in optimizer.param_groups]
    return [list(held) for held in adapter.held]


def native_load_state_dict(optimizer):
    """The optimizer's own `load_state_dict`, which indexes the tensors of `held_groups` (the
    master pieces, once adopted), not the single-process format the patched one takes."""
    adapter = adapter_of(optimizer)
    if adapter is None or not adapter.adopted:
        return optimizer.load_state_dict
    return adapter.native_load


def optimizer_state_dict(optimizer) -> dict:
    """`px.optimizer_state_dict(optimizer)`: the optimizer's state in a single process's format,
    on every rank. A collective under zero1, zero2 and zero3: every rank must call it."""
    adapter = adapter_of(optimizer)
    if adapter is None:
        return optimizer.state_dict()
    return adapter.full_state_dict()


def _has_stepped(optimizer) -> bool:
    """Whether the optimizer holds state from steps taken (or loaded), not only what its
    constructor made (Adagrad's accumulators at step 0)."""
    for state in optimizer.state.values():
        step = state.get("step", 0)
        if float(step) > 0 or (state and "step" not in state):
            return True
    return False


def _init_state_for_masters(optimizer) -> None:
    """Drop the state an optimizer made for the model's parameters at construction and make it
    for the masters instead (Adagrad creates its accumulators in __init__)."""
    optimizer.state.clear()
    for own in getattr(optimizer, "optimizers", [optimizer]):  # a chain's: chained.py
        _init_adagrad(own)


def _init_adagrad(optimizer) -> None:
    if isinstance(optimizer, torch.optim.Adagrad):
        for group in optimizer.param_groups:
            for m in group["params"]:
                optimizer.state[m] = {
                    "step": torch.tensor(0.0),
                    "sum": torch.full_like(m, group["initial_accumulator_value"],
                                           memory_format=torch.preserve_format),
                }
