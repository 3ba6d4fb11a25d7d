"""The flat engine: one mechanism behind every strategy and precision.

Per step, for every policy of policy.py:
  backward   each gradient lands in its unit's bucket (reducer.py); a complete bucket is
             averaged over ranks while backward goes on: all-reduced in place where the policy
             keeps full gradients (every `.grad` is then the true mean over ranks), reduced to
             the owned shard where it shards them (the full bucket is given back to a pool of
             two, or is autograd's own gradient and goes with it, and `.grad` is None; one
             bucket at most stays in flight while the next fills). Flags riding in the same
             collective (or one of their own beside it) say which parameters got a gradient
             on any rank.
  step       unit by unit, the owned reduced gradient (cast to the master dtype and unscaled
             under fp16) becomes the `.grad` of the unit's master pieces, the user's optimizer
             updates them, and `unit.unshard()` puts the update into the parameters on every
             rank while the next unit steps.

Under fp32 ddp the parameters are their own masters (flat.py) and the user's optimizer is left
untouched: `optimizer.step()` reads the bucket views directly. Everything else, from the hooks
to the unused-parameter rule and the launch order, is the same code.

The engine owns its parts, each a class of its own given what it needs when it is built: the
units (flat.py), the reducer (reducer.py), zero3's gatherer (zero3.py), the masters as the rest
of phalanx reads them (state.py), the stepper (stepping.py), the step vote (vote.py), its part
in continue mode's generations (generations.py) and the optimizer's adapter (optim.py), beside
the features of `parts()`. What it keeps itself is the wiring between them: the reducer's
launch and finish of each unit, and the end of each backward ([Note: one host read per step]).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch

from ..comm import host
from ..comm.collectives import Comm
from ..comm.gate import continuing, step_lost
from ..comm.records import StepCounter
from .amp import route_grad_scaler, scaler_in_use
from .buckets import BufferPool, GradBucket, aligned_numel
from .clipping import clip_units
from .delayed import DelayedGrads
from .flat import FlatUnit, UnitContext
from .generations import Generations
from .offload import HostLink, step_on_host
from .optim import OptimizerAdapter, optimizer_groups
from .optimizer_kinds import block_size, whole_rule
from .owners import WholeParams
from .policy import HOST, ShardPolicy
from .powersgd import PowerSGDReducer
from .reducer import GradReducer
from .remote import service_for
from .state import Masters
from .stepping import Stepper
from .units import borrows, module_units, step_run_bytes
from .vote import StepVote
from .zero3 import UnitGatherer

__all__ = ["FlatEngine", "UnitOptions", "Features"]


@dataclass(frozen=True)
class UnitOptions:
    """How an engine groups its parameters into units and, under zero3, gathers them.

    bucket_mb: the size of a unit (units.py); block_classes: the classes whose instances are
    the repeated blocks, a unit each (units.py); gather: zero3's prefetch, max_gathered_bytes
    and reshard_after_forward (zero3.py's UnitGatherer), None for its defaults."""
    bucket_mb: float = 25.0
    block_classes: tuple[type, ...] | None = None
    gather: dict | None = None


@dataclass(frozen=True)
class Features:
    """What an engine runs beside its strategy, where asked for.

    staleness: 1 applies each step's averaged gradients at the next step (delayed.py);
    replicas: shard_size's average across shard groups, the engine's `comm` being the group
        (hybrid.py); compression: a px.PowerSGD (powersgd.py); buffers: what keeps the buffers
        equal at the end of each backward that synchronises (model/buffers.py);
    step_in_backward: each unit stepped as soon as its gradient is reduced ([Note: the step
        in backward] in stepping.py)."""
    staleness: int = 0
    replicas: object = None
    compression: object = None
    buffers: object = None
    step_in_backward: bool = False


class FlatEngine:
    """Implements the `Engine` protocol (engine/__init__.py) for every strategy of policy.py.

    units: how the parameters form units (default `UnitOptions()`); features: what runs beside
    the strategy (default none); nonfinite: the NonFiniteWatch of faults/nonfinite.py, or None;
    steps: the model's StepCounter (comm/records.py), a fresh one by default."""

    def __init__(self, module: torch.nn.Module, optimizer, comm: Comm, policy: ShardPolicy, *,
                 precision, units: UnitOptions | None = None, features: Features | None = None,
                 nonfinite=None, steps: StepCounter | None = None):
        units, features = units or UnitOptions(), features or Features()
        self.comm, self.policy, self.precision = comm, policy, precision
        self.world, self.rank = comm.world, comm.rank
        self.sharded = policy.shards_optimizer(self.world)
        self.shard_grads = policy.shards_grads(self.world)
        self.reshards = policy.reshards(self.world)  # zero3: zero3.py
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.replicas = features.replicas  # shard_size: the average across groups (hybrid.py)
        self.buffers = features.buffers  # rank 0's buffers at each synchronised backward's end
        self.nonfinite = nonfinite  # a NonFiniteWatch (faults/nonfinite.py), or None
        self.steps = steps if steps is not None else StepCounter()  # this model's optimizer steps
        self.loss_scaler = precision.loss_scaler
        # offload: the masters (and with them the optimizer state) in host memory (offload.py)
        self.host_link = HostLink(next(module.parameters()).device) \
            if policy.masters is HOST and self.params else None
        self.step_in_backward = features.step_in_backward  # [Note: the step in backward]
        self.adopt = self._adopts(optimizer, features.staleness)
        self.stepped_in_backward = False  # some unit stepped in the last backward
        self._publishing: list = []       # their updates' gathers, waited at backward's end
        self._deferred: list = []         # their whole parameters, stepped at backward's end
        # the step's collectives in backward go on a group of their own: a sequence ordered
        # by the units' finishing (the same on every rank), apart from the reductions', which
        # one rank may launch before another finishes ([Note: the step in backward])
        self.backward_steps = comm.apart("step in backward") \
            if self.step_in_backward and self.world > 1 else comm
        # a state kept in blocks (torchao's low-bit optimizers): shards cut on block bounds
        self.align = (block_size(optimizer) or 1) if optimizer is not None and self.sharded else 1
        self.pool, self.units, self.frozen_units = self._lay_out(module, units, features)
        self.delayed = DelayedGrads(self) if features.staleness else None  # [Note: staleness=1]
        self.compression = PowerSGDReducer(features.compression, self.units, self.params) \
            if features.compression is not None and self.units else None
        self.patience = 0.05   # seconds a root waits for its predecessors' flags (_may_wait)
        self._gave_up = False  # a wait in this backward was given up (_may_wait)
        self._unsettled: list[FlatUnit] = []  # finished in this backward, flags not read yet
        # See [Note: waiting for a reduction in backward] in reducer.py: zero3 where a wait
        # blocks the host (gloo; NCCL's holds the stream, and the host goes on gathering)
        self._host_waits = self.reshards and bool(self.units) and not comm.polls
        self.gatherer, self.remote = self._gathering(module, units)
        self.masters = Masters(self.units, self.frozen_units, self.params, comm, policy,
                               remote=self.remote, gatherer=self.gatherer,
                               optimizer_parts=self._optimizer_parts)
        self.remote_id = self.masters.remote_id  # this engine's name in the shard service
        # See [Note: the step vote] in vote.py: an exception in one rank's step
        self.vote = StepVote(self, self.replicas.job.world if self.replicas is not None
                             else self.world)
        self.reducer = GradReducer([u.bucket for u in self.units], self._launch, self._finish,
                                   on_first_order=self._reorder if self.world > 1 else None,
                                   max_in_flight=1 if self.shard_grads else None,
                                   signal=self._signal, on_end=self._after_backward,
                                   may_wait=self._may_wait if self._host_waits else None)
        self.generations = Generations(comm, self.reducer)
        # See [Note: whole parameters on owner ranks] in owners.py
        self.wholes = self._wholes(module, optimizer)
        # See [Note: fp32 gradients a few units at a time] in units.py
        self.step_chunk_bytes = step_run_bytes(units.bucket_mb)
        self.stepper = Stepper(self.units, self.params, self.masters, optimizer, comm, policy,
                               delayed=self.delayed, loss_scaler=self.loss_scaler,
                               step_chunk_bytes=self.step_chunk_bytes,
                               on_host=partial(step_on_host, self)
                               if self.host_link is not None else None,
                               wholes=self.wholes,
                               fp32_runs=self.precision.rounding is not None)
        self.optim = OptimizerAdapter(optimizer, self, module) if optimizer is not None else None
        if self.optim is not None:  # [Note: torch.amp's GradScaler on a prepared model] in amp.py
            route_grad_scaler()

    # -- building ---------------------------------------------------------------------------
    def _adopts(self, optimizer, staleness: int) -> bool:
        """Whether the optimizer is adopted (its params become master pieces): unless every
        parameter is its own master, with no sharding, no low precision, no staleness and no
        offload."""
        compute = self.precision.compute_dtype
        low = any(compute is not None and p.dtype != compute for p in self.params)
        adopt = self.sharded or low or staleness > 0 or self.host_link is not None \
            or self.step_in_backward or self.precision.rounding is not None
        if self.step_in_backward and optimizer is None and self.params:
            raise ValueError("step_in_backward=True steps the optimizer inside backward, so it "
                             "needs the optimizer: px.prepare(model, optimizer, ...)")
        if adopt and optimizer is None and self.params:
            raise ValueError(
                f"strategy {self.policy.name!r} with precision {self.precision.name!r} needs the "
                "optimizer: px.prepare(model, optimizer, ...)")
        return adopt

    def _lay_out(self, module: torch.nn.Module, options: UnitOptions, features: Features):
        """The units, with gradients and (zero3) of frozen parameters only, and the pool their
        buckets borrow from: (pool, units, frozen units)."""
        compute = self.precision.compute_dtype
        # zero3 shards frozen parameters too, in the units of the modules that hold them
        # (see [Note: frozen parameters in a unit] in flat.py)
        members = [p for p in module.parameters()
                   if p.requires_grad or (self.reshards and p.is_floating_point())]
        itemsize = torch.empty((), dtype=compute or members[0].dtype).element_size() \
            if members else 4
        # In a world of one with nothing to adopt there is nothing to do: the module is trained
        # exactly as without phalanx, with no hooks at all.
        # (PowerSGD changes what a step applies, so a world of one runs it too: powersgd.py)
        plain = self.world == 1 and not self.adopt and features.compression is None
        runs = module_units(module, members, itemsize, options.bucket_mb, options.block_classes,
                            compute) if members and not plain else []
        # Units with gradients first (a bucket's index is its unit's), then frozen ones only.
        split = [([p for p in run if p.requires_grad], [p for p in run if not p.requires_grad])
                 for run in runs]
        split = [s for s in split if s[0]] + [s for s in split if not s[0]]
        # ZeRO-2 and zero3 lend their short-lived bucket buffers from a pool of two: one
        # reduced but unfinished (max_in_flight below) and one filling. A unit of one
        # parameter needing no padding borrows none: its gradient is reduced in the tensor
        # autograd made (see [Note: a gradient reduced where autograd made it] in buckets.py).
        pool = None
        pooled = [run for run, _ in split if run and borrows([p.numel() for p in run],
                                                             self.world, self.align)]
        if self.shard_grads and pooled:
            largest = max(aligned_numel([p.numel() for p in run], self.align, self.world)
                          + self.world for run in pooled)
            largest += max(len(run) for run in pooled)  # the flags (the signal: in the pad)
            pool = BufferPool(largest, compute or pooled[0][0].dtype, pooled[0][0].device,
                              keep=2)
        context = UnitContext(self.policy, self.world, self.rank, adopt=self.adopt, pool=pool,
                              host=self.host_link, align=self.align)
        every = [FlatUnit(i, trained, frozen, compute_dtype=compute or (trained + frozen)[0].dtype,
                          context=context)
                 for i, (trained, frozen) in enumerate(split)]
        return pool, [u for u in every if u.params], [u for u in every if not u.params]

    def _wholes(self, module: torch.nn.Module, optimizer) -> WholeParams | None:
        """A matrix-wise optimizer's parameters stepped whole on owner ranks (owners.py),
        where the optimizer state is sharded; None where every parameter steps in pieces."""
        rule = whole_rule(optimizer) if optimizer is not None else None
        if rule is None or not self.sharded or not self.adopt:
            return None
        groups = optimizer.param_groups
        wholes = WholeParams(self.units, rule, {p: groups[g] for p, g in
                                                optimizer_groups(optimizer, module).items()},
                             self.comm)
        if not wholes:
            return None
        name = type(optimizer).__name__
        if self.host_link is not None:
            raise ValueError(
                f"offload='optimizer' with {name}, which needs whole matrices: the owners' "
                "exchange runs on the device and is not written for masters in host memory; "
                "use offload=None (zero3 shards the state 1/N per rank), or an element-wise "
                "optimizer such as AdamW")
        if continuing():
            raise ValueError(
                f"--on-failure continue with {name} under a sharded strategy: a step lost "
                "mid-exchange would leave the owners' matrices half-written; use strategy="
                "'ddp', an element-wise optimizer such as AdamW, or --on-failure stop")
        return wholes

    def _gathering(self, module: torch.nn.Module, options: UnitOptions):
        """zero3's gatherer (or None) and the shard service (remote.py; None unless the masters
        are sharded): (gatherer, service). The gathers' group is made before the service (each
        a collective of the ranks, in this order on every rank)."""
        gathers = None
        if self.reshards and self.all_units:
            # Gathers on a group of their own: see [Note: two sequences of collectives]
            gathers = self.comm.apart("zero3:gathers")
        # See [Note: reading a peer's shards] in remote.py: where this rank holds 1/N of the
        # masters, a thread serves them (and the optimizer state) to a peer that asks.
        remote = service_for(self.comm) if self.sharded else None
        if gathers is None:
            return None, remote
        return UnitGatherer(module, self.all_units, gathers, block_classes=options.block_classes,
                            finish_reductions=self._finish_reductions if self._host_waits
                            else None,
                            fetch=self._fetch if remote is not None else None,
                            **(options.gather or {})), remote

    def _finish_reductions(self) -> None:
        """The gatherer's, before a root's backward (see [Note: waiting for a reduction in
        backward] in reducer.py)."""
        self.reducer.finish_done(self.patience)

    def _fetch(self, unit: FlatUnit) -> torch.Tensor:
        """The gatherer's, in a forward on one rank alone: the unit's whole buffer read from
        the peers, in its compute dtype (state.py's `fetch_unit`)."""
        return self.masters.fetch_unit(unit, unit.compute_dtype)

    def _optimizer_parts(self) -> dict:
        """The masters' part, for a peer asking for the optimizer state (state.py)."""
        return self.optim.local_parts()

    @property
    def all_units(self) -> list[FlatUnit]:
        """Every unit, by index: those with gradients, then zero3's of frozen parameters."""
        return self.units + self.frozen_units

    # -- the Engine protocol ------------------------------------------------------------------
    def parts(self) -> list:
        """The features this engine runs beside its strategy (PowerSGD's compressor, staleness'
        delayed gradients), in a fixed order: what checkpoints walk for the state each keeps
        across steps (continue mode's refusals of them: model/spec.py's CONTINUE_MODE)."""
        return [part for part in (self.compression, self.delayed) if part is not None]

    def watch_steps(self, optimizer, fn) -> None:
        """Call `fn()` after every `optimizer.step()` of the user's loop: through the adapter
        where the optimizer is adopted (its own step hooks run once per unit there), through
        torch's step post-hook otherwise; not after a step voted down (vote.py)."""
        if self.optim is not None and self.optim.adopted:
            self.optim.after_step.append(fn)
        else:
            optimizer.register_step_post_hook(
                lambda opt, args, kwargs: None if self.vote.dropped else fn())

    def guard_steps(self, optimizer, before) -> None:
        """Ask `before()` as every `optimizer.step()` of the user's loop begins whether the
        step may change anything (continuing/steps.py); when not, its gradients are dropped first,
        so the optimizer (adopted or the user's own) steps nothing."""
        if self.optim is not None and self.optim.adopted:
            self.optim.before_step = before
        else:
            def pre(opt, args, kwargs):
                if not self.vote.dropped and not before():  # dropped: see engine/vote.py
                    self.drop_grads()
            optimizer.register_step_pre_hook(pre)

    def groups(self) -> list:
        """The process groups this engine issues on (the step report reads their records)."""
        comms = [self.comm] + ([self.gatherer.comm] if self.gatherer is not None else [])
        comms += [self.replicas.comm, self.replicas.job] if self.replicas is not None else []
        return [c.group for c in comms if c.group is not None]

    def names_across(self) -> set:
        """The names of the groups whose collectives cross shard groups (hybrid.py): the
        step report counts their bytes apart; none without shard_size (one group)."""
        return {self.replicas.comm.name, self.replicas.job.name} if self.replicas else set()

    def no_sync(self):
        return self.reducer.no_sync()

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.reducer.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.reducer.sync = bool(value)

    # the masters, as the rest of phalanx reads and writes them (state.py)
    def master_values(self) -> dict[int, torch.Tensor] | None:
        return self.masters.values()

    def full_master_values(self) -> dict[int, torch.Tensor]:
        return self.masters.full_values()

    def master_pieces(self) -> dict:
        return self.masters.pieces()

    def held_pieces(self) -> dict:
        return self.masters.held_pieces()

    def publish_masters(self) -> None:
        self.masters.publish()

    def load_masters(self, values: dict[int, torch.Tensor]) -> None:
        self.masters.load(values)

    def open_params(self) -> list:
        return self.masters.open_params()

    def close_params(self, opened: list) -> None:
        self.masters.close_params(opened)

    def peer_optimizer_parts(self) -> list[dict]:
        """Every rank's optimizer parts, the peers' read one-sidedly (optim.py's state_dict)."""
        return self.masters.peer_optimizer_parts()

    def step_units(self, step_one):
        """The adopted optimizer's step (optim.py): the stepper's (stepping.py)."""
        return self.stepper.step_units(step_one)

    # continue mode (generations.py)
    def laid_out_for(self, comm) -> bool:
        return self.generations.laid_out_for(comm)

    def elastic_state(self) -> dict:
        return self.generations.state(self.steps)

    def set_elastic_state(self, state: dict | None) -> None:
        self.generations.set_state(state, self.steps)

    def release(self) -> None:
        """Stop being the engine of its model, for a rebuilt one (model/relayout.py): the
        optimizer given back, the gathers' hooks taken off, the reducer's hooks disarmed, this
        engine no longer served to peers, and every parameter it holds standalone again (a
        trainable one in its own dtype, a frozen one of zero3's in the dtype it was cast to);
        their values are loaded next."""
        if self.optim is not None:
            self.optim.release()
        if self.gatherer is not None:
            self.gatherer.release()
        self.reducer.disarm()
        if self.remote is not None:
            self.remote.retire(self.remote_id)
        for unit in self.all_units:  # zero3's frozen parameters too, in their cast dtype
            unit.standalone()

    # -- backward ----------------------------------------------------------------------------
    def backward_started(self, grad: torch.Tensor | None = None) -> None:
        """From each output's node in backward, with the gradient arriving there."""
        if grad is not None and self.nonfinite is not None:
            self.nonfinite.note(grad)
        self.vote.dropped = False
        self.reducer.backward_started()
        if self.gatherer is not None:
            self.gatherer.backward_started()

    def _signal(self):
        return self.vote.signal(self.nonfinite.signal() if self.nonfinite is not None else 0.0)

    def forward_raised(self, exc: BaseException) -> None:
        """From the prepared model: its forward raised (see [Note: the step vote])."""
        self.vote.forward_raised(exc)

    def _after_backward(self) -> None:
        """[Note: one host read per step]
        The end of a backward that communicated: what the host must know of it comes back in
        one read of the device (host.py): each finished unit's reduced flags and signal (which
        parameters got a gradient on any rank, and whether any rank's loss was non-finite, see
        faults/nonfinite.py), this rank's own non-finite flag, fp16's overflow flag over the
        reduced gradients (all-reduced first where each rank reads its own shard), and zero3's
        checks that the ranks gathered the same modules in this step's forwards
        (zero3_roots.py). Nothing of it when the step is lost (continuing/): what came back is
        this rank's own, and the step is thrown away. A signal that says some rank's step
        raised drops the step on every rank instead ([Note: the step vote] in vote.py)."""
        publishing, self._publishing = self._publishing, []
        for work in publishing:  # [Note: the step in backward] in stepping.py
            work.wait()
        deferred, self._deferred = self._deferred, []
        if deferred:
            with self.vote.stepping():
                self.stepper.step_deferred(deferred, self.optim.step_unit, self.backward_steps)
        if self.stepped_in_backward:
            self.masters.stepped(moved=True)
        if step_lost():
            self._unsettled = []
            self.vote.failing = None
            return self.gatherer.take_checks() if self.gatherer is not None else None
        if self.buffers is not None:  # [Note: buffers as torch DDP keeps them] (model/)
            self.buffers.after_backward()
        if self.delayed is not None:
            return self.delayed.after_backward()
        if self.replicas is not None:
            self.replicas.wait()
        if self.compression is not None:
            self.compression.backward_done()
        units, self._unsettled = self._unsettled, []
        self._gave_up = False
        parts = [u.tail.float() for u in units]
        watch = self.nonfinite
        mine = watch.local if watch is not None else None
        if mine is not None:
            parts.append(mine.reshape(1).float())
        overflow = self._overflow_flag() if self.loss_scaler is not None else None
        if overflow is not None:
            parts.append(overflow)
        checks = self.gatherer.take_checks() if self.gatherer is not None else []
        parts += [ok.reshape(1).float() for _, ok in checks]
        values = host.read(torch.cat(parts)) if parts else []
        at = 0
        for unit in units:
            n = unit.tail.numel()
            unit.take_flags(values[at:at + n], shard=self.shard_grads)
            at += n
        mine_value = bool(values[at]) if mine is not None else False
        at += mine is not None
        if overflow is not None:
            self.stepper.note_overflow(bool(values[at]))
            at += 1
        if any(u.failed for u in units):  # what differed (roots, losses) was the failure's
            if watch is not None:
                watch.local = None
            return self.vote.voted_down(self.replicas.job if self.replicas else self.comm)
        if checks:
            self.gatherer.raise_if_differed(checks, values[at:])
        if watch is None:
            return
        if scaler_in_use():  # see [Note: torch.amp's GradScaler on a prepared model] in amp.py
            watch.after_backward(False, False, self.steps.value)  # nothing flagged
            return
        any_rank = any(u.nonfinite for u in self.units if u.reduced is not None) \
            if self.world > 1 else mine_value
        try:
            drop = watch.after_backward(any_rank, mine_value, self.steps.value) is not None
        except FloatingPointError:  # NonFiniteError: the step's gradients go first
            self.drop_grads()
            raise
        if drop:
            self.drop_grads()

    def _overflow_flag(self) -> torch.Tensor | None:
        """fp16: 1 where some rank's reduced gradients hold an inf or NaN, on the device."""
        ready = [u.reduced for u in self.units if u.reduced is not None]
        if not ready:
            return None
        device = self.comm.device  # offloaded gradient shards are on the host: offload.py
        finite = torch.stack([torch.isfinite(g).all().to(device) for g in ready]).all()
        flag = (~finite).float().reshape(1)
        if self.sharded:  # each rank reads its owned slice: agree (under ddp all are equal)
            self.comm.all_reduce(flag, op="max", tag="loss_scale:found_inf")
        return flag

    def drop_grads(self) -> None:
        """Forget this step's gradients: the next optimizer.step() changes nothing. (Called
        from inside a step or the vote: no catch-up of its own, unlike `zero_grad`.)"""
        self._forget_reduced()
        for p in self.params:
            p.grad = None

    def before_forward(self, grad: bool = True) -> None:
        """Before each forward: a step that raised on this rank is voted down first (see
        [Note: the step vote] in vote.py); zero3 prepares its gathers."""
        self.vote.catch_up()
        if grad:
            self.vote.dropped = False
        if self.gatherer is not None:
            self.gatherer.forward_starts()

    def free_unreduced(self) -> None:
        """Give back the full buckets of a backward that will not be reduced (zero2, zero3)."""
        for unit in self.units:
            if unit.bucket.buffer is not None and self.shard_grads and unit.reduced is None:
                unit.bucket.free()

    def _reorder(self, completed: list[GradBucket]) -> None:
        """See [Note: launch order follows readiness] in reducer.py."""
        order = torch.tensor([b.index for b in completed], dtype=torch.int64,
                             device=self.comm.device)
        self.comm.broadcast(order, src=0, tag="launch order")
        if step_lost():  # rank 0's order never came (continuing/): decide it at the next backward
            self.reducer.rearm_first_order()
            return
        if self.replicas is not None:
            self.replicas.order(order)
        self.reducer.adopt_order(order.tolist())

    def _launch(self, bucket: GradBucket):
        if self.delayed is not None:
            return self.delayed.launch(self.units[bucket.index])
        unit = self.units[bucket.index]
        if self.compression is not None:  # None: this unit goes uncompressed this time
            work = self.compression.reduce(unit, self.comm)
            if work is not None:
                return work
        if self.world == 1:
            return None
        work = unit.reduce_grad(self.comm, self.precision.comm_dtype, shard=self.shard_grads)
        if self.gatherer is not None:  # every gradient of the unit is there: free it
            self.gatherer.reduced(unit)
        return work

    def _may_wait(self, bucket: GradBucket, patience: float) -> bool:
        """See [Note: waiting for a reduction in backward] in reducer.py: whether every rank
        has issued this bucket's reduction, given up to `patience` seconds to show it (once a
        backward: a rank that holds it back will until its backward ends)."""
        probe = self.units[bucket.index].probe
        deadline = time.perf_counter() + (0.0 if self._gave_up else patience)
        while probe is not None and not probe.is_completed():
            if time.perf_counter() >= deadline:
                self._gave_up = self._gave_up or patience > 0
                return False
            time.sleep(1e-4)  # the collectives' threads need the cores more than this loop
        return probe is not None

    def _finish(self, bucket: GradBucket) -> None:
        unit = self.units[bucket.index]
        if self.delayed is not None:
            return self.delayed.finish(unit)
        unit.finish_grad(shard=self.shard_grads)
        if self.replicas is not None:
            self.replicas.average(unit, self.shard_grads, self.precision.comm_dtype)
        if self.host_link is not None and self.shard_grads:  # [Note: gradients go with the
            unit.offload_grad(self.host_link)                 # optimizer] in offload.py
        if self.step_in_backward and self.optim is not None and not step_lost():
            self._step_now(unit)
            return
        self._unsettled.append(unit)

    def _step_now(self, unit: FlatUnit) -> None:
        """See [Note: the step in backward] in stepping.py: read this unit's flags and signal
        now (a host read per unit), and step it unless some rank's step failed or its loss was
        non-finite; then the end of backward decides as always, from the flags as read."""
        values = host.read(unit.tail.float())
        unit.take_flags(values, shard=self.shard_grads)
        if unit.failed or unit.nonfinite:
            unit.tail = torch.tensor(values, device=self.comm.device)  # read again at the end
            self._unsettled.append(unit)
            return
        with self.vote.stepping():
            work, deferred = self.stepper.step_now(unit, self.optim.step_unit,
                                                   self.backward_steps)
        if work is not None:
            self._publishing.append(work)
        if deferred is not None:
            self._deferred.append(deferred)
        self.stepped_in_backward = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget reduced gradients (the prepared model's and the adopted optimizer's
        zero_grad call this); the model's `.grad` are cleared by the caller."""
        self.vote.catch_up()
        self._forget_reduced()

    def _forget_reduced(self) -> None:
        for unit in self.units:
            unit.clear_reduced()
        self.stepper.note_overflow(None)

    # -- clipping -------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over all ranks and shards (clipping.py); nothing to clip,
        and no collective, in a step voted down (vote.py)."""
        self.vote.catch_up()
        if self.step_in_backward:
            raise RuntimeError(
                "clip_grad_norm_ with step_in_backward=True: each unit was stepped in backward "
                "as soon as its gradient was reduced, before the global norm over every "
                "gradient existed; prepare without step_in_backward to clip by the global norm "
                "(a per-parameter clip inside the optimizer's step still works)")
        if self.vote.dropped:
            return self.vote.zero(self.params[0] if self.params else None)
        if self.delayed is not None:  # the gradient the step applies: delayed.py
            self.delayed.take()
        return clip_units(self, max_norm, norm_type)
