"""The flat engine: one mechanism behind every strategy and precision.

Per step, for every policy of policy.py:
  backward   each gradient lands in its unit's bucket (reducer.py); a complete bucket is
             averaged over ranks while backward goes on: all-reduced in place where the policy
             keeps full gradients (every `.grad` is then the true mean over ranks), reduced to
             the owned shard where it shards them (the full bucket is given back to a pool of
             three and `.grad` is None). Flags riding in the same collective say which
             parameters got a gradient on any rank.
  step       unit by unit, the owned reduced gradient (cast to the master dtype and unscaled
             under fp16) becomes the `.grad` of the unit's master pieces, the user's optimizer
             updates them, and `unit.unshard()` puts the update into the parameters on every
             rank while the next unit steps.

Under fp32 ddp the parameters are their own masters (flat.py) and the user's optimizer is left
untouched: `optimizer.step()` reads the bucket views directly. Everything else, from the
hooks to the unused-parameter rule and the launch order, is the same code.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..collectives import Comm
from ..records import StepCounter
from .buckets import BufferPool, GradBucket
from .flat import FlatUnit, Piece
from .zero3 import UnitGatherer
from .optim import OptimizerAdapter
from .policy import SHARD, ShardPolicy
from .reducer import GradReducer
from .units import module_units

__all__ = ["FlatEngine"]


class FlatEngine:
    """Implements the `Engine` protocol (engine/__init__.py) for every strategy of policy.py."""

    def __init__(self, module: torch.nn.Module, optimizer, comm: Comm, policy: ShardPolicy, *,
                 precision, bucket_mb: float = 25.0, gather_options: dict | None = None,
                 block_classes: tuple[type, ...] | None = None):
        self.comm = comm
        self.policy = policy
        self.precision = precision
        self.world, self.rank = comm.world, comm.rank
        self.sharded = policy.optimizer is SHARD and self.world > 1
        self.shard_grads = policy.grads is SHARD and self.world > 1
        self.reshards = policy.params is SHARD and self.world > 1  # zero3: zero3.py
        self.params = [p for p in module.parameters() if p.requires_grad]
        compute = precision.compute_dtype
        low = any(compute is not None and p.dtype != compute for p in self.params)
        # The optimizer is adopted (its params become master pieces) unless every parameter is
        # its own master: no sharding and no low precision.
        self.adopt = self.sharded or low
        if self.adopt and optimizer is None and self.params:
            raise ValueError(
                f"strategy {policy.name!r} with precision {precision.name!r} needs the optimizer: "
                "px.prepare(model, optimizer, ...)")
        itemsize = torch.empty((), dtype=compute or self.params[0].dtype).element_size() \
            if self.params else 4
        # In a world of one with nothing to adopt there is nothing to do: the module is trained
        # exactly as without phalanx, with no hooks at all.
        plain = self.world == 1 and not self.adopt
        runs = module_units(module, self.params, itemsize, bucket_mb, block_classes) \
            if self.params and not plain else []
        # ZeRO-2 lends its short-lived bucket buffers from a pool of three: at most two reduced
        # but unfinished (max_in_flight below) and one filling.
        self.pool = None
        if self.shard_grads and runs:
            largest = max(sum(p.numel() for p in run) + self.world for run in runs)
            largest += max(len(run) for run in runs)  # the flags
            self.pool = BufferPool(largest, compute or runs[0][0].dtype, runs[0][0].device,
                                   keep=3)
        self.units = [FlatUnit(i, run, world=self.world, rank=self.rank, sharded=self.sharded,
                               compute_dtype=compute or run[0].dtype, adopt=self.adopt,
                               pool=self.pool, reshards=self.reshards)
                      for i, run in enumerate(runs)]
        self.gatherer = None
        if self.reshards and self.units:
            # Gathers on a group of their own: see [Note: two sequences of collectives]
            self.gatherer = UnitGatherer(module, self.units, comm.apart("zero3:gathers"),
                                         block_classes=block_classes,
                                         **(gather_options or {}))
        self.nonfinite = None  # a NonFiniteWatch (faults/nonfinite.py), set by px.prepare
        self.steps = StepCounter()  # this model's optimizer steps (px.prepare's own, once set)
        self.reducer = GradReducer([u.bucket for u in self.units], self._launch, self._finish,
                                   on_first_order=self._reorder if self.world > 1 else None,
                                   max_in_flight=2 if self.shard_grads else None,
                                   signal=self._signal, on_end=self._after_backward)
        self.optim = OptimizerAdapter(optimizer, self, module) if optimizer is not None else None
        self.loss_scaler = precision.loss_scaler

    # -- the Engine protocol ------------------------------------------------------------------
    def watch_steps(self, optimizer, fn) -> None:
        """Call `fn()` after every `optimizer.step()` of the user's loop: through the adapter
        where the optimizer is adopted (its own step hooks run once per unit there), through
        torch's step post-hook otherwise."""
        if self.optim is not None and self.optim.adopted:
            self.optim.after_step.append(fn)
        else:
            optimizer.register_step_post_hook(lambda opt, args, kwargs: fn())

    def groups(self) -> list:
        """The process groups this engine issues on (the step report reads their records)."""
        comms = [self.comm] + ([self.gatherer.comm] if self.gatherer is not None else [])
        return [c.group for c in comms if c.group is not None]

    def no_sync(self):
        return self.reducer.no_sync()

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.reducer.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.reducer.sync = bool(value)

    def backward_started(self, grad: torch.Tensor | None = None) -> None:
        """From each output's gate in backward, with the gradient arriving there."""
        if grad is not None and self.nonfinite is not None:
            self.nonfinite.note(grad)
        self.reducer.backward_started()
        if self.gatherer is not None:
            self.gatherer.backward_started()

    def _signal(self):
        return self.nonfinite.signal() if self.nonfinite is not None else 0.0

    def _after_backward(self) -> None:
        """See faults/nonfinite.py: did any rank's loss turn non-finite in this backward?"""
        if self.nonfinite is None:
            return
        any_rank = any(u.nonfinite for u in self.units if u.reduced is not None) \
            if self.world > 1 else None
        try:
            drop = self.nonfinite.after_backward(any_rank, self.steps.value) is not None
        except FloatingPointError:  # NonFiniteError: the step's gradients go first
            self.drop_grads()
            raise
        if drop:
            self.drop_grads()

    def drop_grads(self) -> None:
        """Forget this step's gradients: the next optimizer.step() changes nothing."""
        self.zero_grad()
        for p in self.params:
            p.grad = None

    def before_forward(self) -> None:
        """See [Note: a backward that raised] in reducer.py."""
        if self.gatherer is not None:
            self.gatherer.forward_starts()
        if self.reducer.in_progress():
            if self.reducer.launched_any():
                self.reducer.drain()
                self.reducer.abandon()
                raise RuntimeError(
                    "the previous backward stopped (raised) after this rank had started "
                    "averaging gradients with the other ranks, so its collectives can no longer "
                    "be matched with theirs. Skip a batch before its backward (in the forward or "
                    "the loss), or end the run and resume from a checkpoint")
            self.reducer.abandon()
            for unit in self.units:
                if unit.bucket.buffer is not None and self.shard_grads and unit.reduced is None:
                    unit.bucket.free()

    def _reorder(self, completed: list[GradBucket]) -> None:
        """See [Note: launch order follows readiness] in reducer.py."""
        order = torch.tensor([b.index for b in completed], dtype=torch.int64,
                             device=self.comm.device)
        self.comm.broadcast(order, src=0, tag="launch order")
        by_index = {b.index: b for b in self.reducer.buckets}
        self.reducer.set_buckets([by_index[i] for i in order.tolist()])

    # -- backward ----------------------------------------------------------------------------
    def _launch(self, bucket: GradBucket):
        if self.world == 1:
            return None
        unit = self.units[bucket.index]
        work = unit.reduce_grad(self.comm, self.precision.comm_dtype, shard=self.shard_grads)
        unit.reshard()  # zero3: every gradient of the unit is there, its values are not needed
        return work

    @contextmanager
    def full_params(self):
        """zero3: every unit gathered for the duration (a collective), then freed; for
        state_dict() and load_state_dict(). Nothing to do under the other strategies."""
        if self.gatherer is None:
            yield
            return
        self.gatherer.gather(self.units)
        try:
            yield
        finally:
            self.gatherer.free_all()

    def _finish(self, bucket: GradBucket) -> None:
        self.units[bucket.index].finish_grad(shard=self.shard_grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget reduced gradients (the prepared model's and the adopted optimizer's
        zero_grad call this); the model's `.grad` are cleared by the caller."""
        for unit in self.units:
            unit.clear_reduced()

    # -- step ----------------------------------------------------------------------------------
    def step_units(self, step_one):
        """Run `step_one()` once per unit that has a reduced gradient, with that unit's master
        pieces holding their fp32 (master dtype) gradient, and publish each unit's update.

        [Note: fp32 gradients one unit at a time]
        The optimizer skips parameters whose `.grad` is None, and an element-wise optimizer
        keeps per-tensor state, so stepping one unit's pieces at a time is the same update as
        stepping all at once. With bf16/fp16 compute the optimizer needs gradients in the master
        dtype; made all at once they would add 4 bytes per owned parameter at the peak, while
        unit by unit at most one unit's worth exists (when the dtypes agree the gradient is the
        reduced buffer itself, no copy). And a unit's all-gather is on the wire while the next
        unit steps. The optimizer's step hooks therefore run once per unit.
        """
        ready = [u for u in self.units if u.reduced is not None]
        if not ready:
            return False
        unscale = 1.0
        if self.loss_scaler is not None:
            found = self.loss_scaler.found_inf([u.reduced for u in ready], self.comm)
            unscale = 1.0 / self.loss_scaler.scale
            self.loss_scaler.update(found)
            if found:
                return False
        works = []
        for unit in ready:
            unit.sync_master_from_cache()  # See [Note: the shard is the truth] in flat.py
            grad = unit.reduced
            if grad.dtype != unit.master_dtype or unscale != 1.0:
                grad = grad.to(unit.master_dtype).mul_(unscale)
            unit.set_piece_grads(grad)
            step_one()
            unit.set_piece_grads(None)
            if not self.reshards:  # zero3 gathers at the next forward (zero3.py)
                works.append(unit.unshard(self.comm))  # on the wire while the next unit steps
        for work in works:
            if work is not None:
                work.wait()
        return True

    # -- clipping -------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over all ranks and shards, computed once, shared by all."""
        if not self.units:
            return torch.nn.utils.clip_grad.clip_grad_norm_(
                [p for p in self.params if p.grad is not None], max_norm, norm_type=norm_type)
        units = [u for u in self.units if u.reduced is not None]
        device = self.units[0].bucket.device
        dtype = self.units[0].master_dtype
        unscale = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        norm_type = float(norm_type)
        grads = [u.reduced.to(dtype) for u in units]
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).amax() if grads \
                else torch.zeros((), dtype=dtype, device=device)
            total = local.reshape(1) * unscale
            if self.sharded:
                self.comm.all_reduce(total, op="max", tag="clip_grad_norm")
        else:
            local = sum((g.abs().pow(norm_type).sum() for g in grads),
                        torch.zeros((), dtype=dtype, device=device))
            total = local.reshape(1)
            if self.sharded:
                self.comm.all_reduce(total, op="sum", tag="clip_grad_norm")
            total = total.pow(1.0 / norm_type) * unscale
        total = total.reshape(())
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for unit in units:
            # Under full gradients the whole bucket is scaled, so every `.grad` stays the
            # clipped mean; under sharded gradients only the owned slice exists.
            target = unit.reduced if self.shard_grads else unit.bucket.grads()
            target.mul_(coef.to(target.dtype))
        return total

    # -- state ----------------------------------------------------------------------------------
    @torch.no_grad()
    def master_values(self) -> dict[int, torch.Tensor] | None:
        """id(param) -> its full master value, where this rank holds all of it without a
        collective (not sharded); None when the masters are sharded."""
        if self.sharded:
            return None
        for unit in self.units:
            unit.sync_master_from_cache()
        out = {}
        for unit in self.units:
            for piece in unit.pieces:
                p = unit.params[piece.param_index]
                out[id(p)] = piece.master.detach().view_as(p)
        return out

    @torch.no_grad()
    def master_pieces(self) -> dict[int, list[Piece]]:
        """id(param) -> the pieces of its master that this rank holds, for every trainable
        parameter: the owned slices when sharded, the whole parameter otherwise (a parameter
        that is its own master is its own piece). Edits made behind phalanx's back are taken
        into the masters first, so the pieces hold the truth."""
        out: dict[int, list[Piece]] = {}
        for unit in self.units:
            unit.sync_master_from_cache()
            for piece in unit.pieces:
                out.setdefault(id(unit.params[piece.param_index]), []).append(piece)
        for p in self.params:  # a world of one with nothing to adopt has no units
            out.setdefault(id(p), [] if self.sharded else [Piece.whole(p)])
        return out

    @torch.no_grad()
    def publish_masters(self) -> None:
        """Refresh the parameters from masters written in place (through `master_pieces`):
        a collective when the masters are sharded, so every rank calls it. (zero3 keeps no
        parameters between steps: the next forward gathers them from the masters.)"""
        if self.reshards:
            return
        for unit in self.units:
            unit.unshard(self.comm, async_op=False)

    @torch.no_grad()
    def load_masters(self, values: dict[int, torch.Tensor]) -> None:
        """Set the masters from full-precision values, keyed by id(param); then refresh the
        parameters from them (no collective: every rank was given the same values)."""
        for unit in self.units:
            unit.load_master([values.get(id(p)) for p in unit.params])
            if unit.flat is not None and not unit.master_is_view and not unit.reshards:
                for p, offset in zip(unit.params, unit.bucket.offsets):
                    v = values.get(id(p))
                    if v is not None:
                        unit.flat[offset:offset + p.numel()].copy_(v.reshape(-1))
