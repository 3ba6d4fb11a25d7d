"""Sharded data parallelism: ZeRO stages 1 and 2, and mixed-precision replication.

One mechanism, several policies (ZeRO: Rajbhandari et al., 2020, arXiv:1910.02054).

The model's trainable parameters are laid out in flat *units* (one per gradient bucket): each
parameter becomes a view into its unit's flat parameter buffer, in the compute dtype. A unit's
buffer is padded to a multiple of the world size and cut into equal shards; rank r owns shard r.
The user's optimizer keeps its class, hyper-parameters and param groups, but its params become
the fp32 *master* tensors of the shards this rank owns, so its state (Adam's moments...) exists
for 1/N of the model only. This is exact for optimizers whose update is element-wise, which is
why other optimizers are refused rather than silently stepped differently.

Per step:
  backward   gradients land in flat buckets (reducer.py) and each bucket is averaged over ranks
             while backward goes on; the owned slice of the result is kept, in the compute dtype.
  step       unit by unit, the owned slice becomes the master's fp32 `.grad`, the optimizer
             updates the master, and the update is written back into the flat parameter buffer
             (cast to the compute dtype) and all-gathered while the next unit steps.

What the policies change is only what stays resident:

  policy  optimizer state  gradients between steps        masters
  ddp     full             full (bucket buffers kept)     full fp32 copy (mixed precision only)
  zero1   1/N              full (bucket buffers kept)     1/N
  zero2   1/N              1/N (bucket buffers freed)     1/N

With fp32 compute the master is the owned slice of the flat parameter buffer itself (no copy),
and for ddp/zero1 its gradient is the owned slice of the bucket (no copy either).

After backward the model's parameters hold the averaged gradient (views into the kept buckets,
in the compute dtype) under ddp and zero1 on gloo; under zero2, and zero1 with reduce-scatter
(NCCL), only the owned shard is reduced and their `.grad` is None. `px.clip_grad_norm_` works
on every policy; prefer it to torch's.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import collectives as C
from .buckets import BufferPool, GradBucket, assign_buckets
from .consistency import optimizer_groups
from .loss_scaling import DynamicLossScaler
from .reducer import GradReducer

__all__ = ["ShardPolicy", "POLICIES", "Sharded", "ELEMENTWISE_OPTIMIZERS"]

_FIRST_BUCKET_MB = 1.0

# Optimizers whose update of each element depends only on that element's own gradient, state
# and the group's hyper-parameters: stepping on flat shards gives bit-for-bit the same update.
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam",
     "RMSprop", "Rprop") if hasattr(torch.optim, name))


@dataclass(frozen=True)
class ShardPolicy:
    name: str
    shard_optimizer: bool  # ZeRO-1: each rank keeps masters and optimizer state for its shard
    shard_grads: bool      # ZeRO-2: each rank keeps only its shard's reduced gradients


POLICIES = {
    "ddp": ShardPolicy("ddp", shard_optimizer=False, shard_grads=False),
    "zero1": ShardPolicy("zero1", shard_optimizer=True, shard_grads=False),
    "zero2": ShardPolicy("zero2", shard_optimizer=True, shard_grads=True),
}


class _Unit:
    """One flat run of parameters: their compute-dtype buffer, gradient bucket and master shard."""

    def __init__(self, index, params, group_index, world, rank, sharded, compute_dtype, pool):
        self.params = params
        self.group_index = group_index
        self.bucket = GradBucket(index, params, pad_to=world if sharded else 1,
                                 dtype=compute_dtype, pool=pool)
        n = self.bucket.padded_numel
        device = params[0].device
        shard = n // world if sharded else n
        self.lo, self.hi = (rank * shard, (rank + 1) * shard) if sharded else (0, n)
        self.master_is_view = compute_dtype == torch.float32
        full = torch.zeros(n, dtype=torch.float32, device=device)
        for p, offset in zip(params, self.bucket.offsets):
            full[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
        # The masters start from the user's fp32 values, not from their low-precision copy.
        master = None if self.master_is_view else full[self.lo:self.hi].clone()
        self.flat = full if self.master_is_view else full.to(compute_dtype)
        del full
        for p, offset in zip(params, self.bucket.offsets):
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
        self.master = torch.nn.Parameter(self.flat[self.lo:self.hi] if master is None else master)
        self.grad_shard: torch.Tensor | None = None  # zero2: the reduced shard, kept to the step
        self.reduced: torch.Tensor | None = None  # the owned reduced gradient, compute dtype


class Sharded:
    """Flat-parameter engine behind zero1, zero2 and mixed-precision ddp."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, group,
                 policy: ShardPolicy, compute_dtype: torch.dtype = torch.float32,
                 comm_dtype: torch.dtype | None = None, bucket_mb: float = 25.0,
                 loss_scaler: DynamicLossScaler | None = None):
        if optimizer is None:
            raise ValueError(f"strategy/precision {policy.name!r} with low precision or sharding "
                             "needs the optimizer: px.prepare(model, optimizer, ...)")
        _check_elementwise(optimizer)
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.policy = policy
        self.sharded = policy.shard_optimizer and self.world > 1
        self.compute_dtype = compute_dtype
        self.comm_dtype = comm_dtype if comm_dtype != compute_dtype else None
        self.loss_scaler = loss_scaler
        self.optimizer = optimizer
        self.reduce_scatter = self.sharded and not C.backend_prefers_all_reduce(group)

        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True) to "
                             "shard or train in low precision")
        group_of = _optimizer_groups(optimizer, module, params)
        cap = int(bucket_mb * 2**20)
        first_cap = min(cap, int(_FIRST_BUCKET_MB * 2**20))
        ordered = list(reversed(params))  # backward produces gradients in about this order
        itemsize = torch.empty((), dtype=compute_dtype).element_size()
        # Sizes in the compute dtype decide the buckets; optimizer groups never share a unit.
        runs = assign_buckets(ordered, int(cap * 4 / itemsize) if itemsize < 4 else cap,
                              int(first_cap * 4 / itemsize) if itemsize < 4 else first_cap,
                              key=lambda p: (group_of[p], p.device))
        # ZeRO-2 lends its short-lived bucket buffers from a pool of three: at most two reduced
        # but unfinished (max_in_flight below) and one filling.
        self.pool = None
        if policy.shard_grads:
            largest = max(sum(p.numel() for p in run) + self.world for run in runs)
            self.pool = BufferPool(largest, compute_dtype, params[0].device, keep=3)
        self.units = [_Unit(i, run, group_of[run[0]], self.world, self.rank, self.sharded,
                            compute_dtype, self.pool) for i, run in enumerate(runs)]
        self._comm: dict[int, torch.Tensor] = {}
        # ZeRO-2 keeps at most two full buckets reduced-but-unfinished, so the full gradients
        # resident at any time during backward are a few buckets, not the whole model.
        self.reducer = GradReducer([u.bucket for u in self.units], self._launch, self._finish,
                                   max_in_flight=2 if policy.shard_grads else None)

        for g, param_group in enumerate(optimizer.param_groups):
            param_group["params"] = [u.master for u in self.units if u.group_index == g]
        self._masters = {id(u.master) for u in self.units}
        _init_state_for_masters(optimizer, [u.master for u in self.units])
        # Instance attributes, so the optimizer keeps its class. Plain functions rather than
        # this engine's bound methods: an LR scheduler created later re-binds `step.__func__`
        # to the optimizer, which must still land here.
        self._user_step = optimizer.step
        self._user_zero_grad = optimizer.zero_grad
        engine = self
        optimizer.step = types.MethodType(lambda opt, closure=None: engine.step(closure),
                                          optimizer)
        optimizer.zero_grad = types.MethodType(
            lambda opt, set_to_none=True: engine.zero_grad(set_to_none), optimizer)
        # Frozen parameters and floating buffers follow the compute dtype, so layers that mix
        # them with trainable weights (BatchNorm's running statistics, a frozen embedding) see
        # one dtype.
        if compute_dtype != torch.float32:
            with torch.no_grad():
                for p in module.parameters():
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(compute_dtype)
                for b in module.buffers():
                    if b.is_floating_point():
                        b.data = b.data.to(compute_dtype)

    # -- backward ------------------------------------------------------------------------
    def _launch(self, bucket: GradBucket):
        if self.group is None:
            return None
        unit = self.units[bucket.index]
        buf = bucket.grads()
        if self.comm_dtype is not None:
            buf = bucket.copy_for_comm(self.comm_dtype)  # no flags here: the same elements
        if self.reduce_scatter:
            out = torch.empty(unit.hi - unit.lo, dtype=buf.dtype, device=buf.device)
            self._comm[bucket.index] = out
            return C.reduce_scatter_mean(out, buf, self.group)
        self._comm[bucket.index] = buf
        return C.all_reduce_mean(buf, self.group)

    def _finish(self, bucket: GradBucket) -> None:
        """Keep the owned slice of the reduced bucket, in the compute dtype, for the step."""
        unit = self.units[bucket.index]
        reduced = self._comm.pop(bucket.index, None)
        if reduced is None:
            reduced = bucket.grads()
        owned = reduced if self.reduce_scatter else reduced[unit.lo:unit.hi]
        # After a reduce-scatter the bucket outside the owned slice still holds this rank's own
        # unreduced gradients, so it cannot be accumulated into: keep the shard apart, as zero2.
        if self.policy.shard_grads or self.reduce_scatter:
            if unit.grad_shard is None:
                unit.grad_shard = torch.empty(unit.hi - unit.lo, dtype=self.compute_dtype,
                                              device=owned.device)
            # A second backward before zero_grad() accumulates, as in one process.
            if unit.reduced is None:
                unit.grad_shard.copy_(owned)
            else:
                unit.grad_shard.add_(owned)
            unit.reduced = unit.grad_shard
            for p in unit.params:
                p.grad = None
            if self.policy.shard_grads:
                bucket.free()
        else:
            # The bucket is kept and the parameters keep their views into it, so a second
            # backward accumulates into it in place (before the reduction; the mean of a sum
            # already equal on every rank plus the new gradients is that sum plus their mean).
            target = bucket.grads()[unit.lo:unit.hi]
            if target.data_ptr() != owned.data_ptr():
                target.copy_(owned)
            unit.reduced = target

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`optimizer.zero_grad()`: clear the masters' gradients and the reduced ones behind
        them, and the model parameters' views, so the next backward starts from zero."""
        self._user_zero_grad(set_to_none=set_to_none)
        self.clear_reduced()
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    def clear_reduced(self) -> None:
        """Forget the reduced gradients (also called by the prepared model's zero_grad)."""
        for unit in self.units:
            unit.reduced = None

    # -- step ----------------------------------------------------------------------------
    def _check_param_groups(self) -> None:
        for param_group in self.optimizer.param_groups:
            for p in param_group["params"]:
                if id(p) not in self._masters:
                    raise RuntimeError(
                        "the optimizer holds a parameter that was added after px.prepare; "
                        "add every parameter to the optimizer before calling px.prepare")

    def step(self, closure=None):
        """Step the user's optimizer on the masters of this rank's shards, then publish.

        [Note: fp32 gradients one unit at a time]
        The optimizer steps unit by unit: it skips parameters whose `.grad` is None, and an
        element-wise optimizer keeps per-tensor state, so stepping one unit's master at a time
        is the same update as stepping all at once. Two things follow. With bf16/fp16 compute
        the optimizer needs fp32 gradients; made all at once they would add 4 bytes per owned
        parameter at the peak, beyond the ZeRO layout, while unit by unit at most one bucket's
        worth exists (with fp32 compute the gradient is the reduced buffer itself, no copy).
        And a unit's all-gather is on the wire while the next unit steps.
        The optimizer's step hooks therefore run once per unit.
        """
        self._check_param_groups()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ready = [u for u in self.units if u.reduced is not None]
        if not ready:
            return loss
        unscale = 1.0
        if self.loss_scaler is not None:
            found = self.loss_scaler.found_inf([u.reduced for u in ready], self.group,
                                               self.units[0].flat.device)
            unscale = 1.0 / self.loss_scaler.scale
            self.loss_scaler.update(found)
            if found:
                self.zero_grad()  # the overflowed gradients are of no use to a later step
                return loss
        for unit in self.units:
            unit.master.grad = None
        works = []
        for unit in ready:  # See [Note: fp32 gradients one unit at a time]
            grad = unit.reduced
            if grad.dtype != torch.float32 or unscale != 1.0:
                grad = grad.float().mul_(unscale)
            unit.master.grad = grad
            self._user_step()
            unit.master.grad = None
            works.append(self._publish_unit(unit))  # on the wire while the next unit steps
        for work in works:
            if work is not None:
                work.wait()
        return loss

    @torch.no_grad()
    def _publish_unit(self, unit: _Unit):
        """Write a unit's updated master into its compute-dtype parameters on every rank."""
        if not unit.master_is_view:
            unit.flat[unit.lo:unit.hi].copy_(unit.master)
        if self.sharded:
            return C.all_gather_into(unit.flat, unit.flat[unit.lo:unit.hi], self.group,
                                     async_op=True)
        return None

    @torch.no_grad()
    def params_changed(self) -> None:
        """Refresh the fp32 masters after the model's parameters were loaded or edited."""
        for unit in self.units:
            if not unit.master_is_view:
                unit.master.copy_(unit.flat[unit.lo:unit.hi])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip with the global norm over all shards, computed once and shared by all ranks."""
        grads = [u.reduced for u in self.units if u.reduced is not None]
        device = self.units[0].flat.device
        unscale = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max().float() for g in grads]).amax() if grads \
                else torch.zeros((), device=device)
            total = local.reshape(1) * unscale
            if self.sharded:
                C.all_reduce_max(total, self.group)
        else:
            local = sum((g.float().abs().pow(norm_type).sum() for g in grads),
                        torch.zeros((), device=device))
            total = local.reshape(1)
            if self.sharded:
                C.all_reduce_sum(total, self.group)
            total = total.pow(1.0 / norm_type) * unscale
        total = total.reshape(())
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total


def _check_elementwise(optimizer) -> None:
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"{type(optimizer).__name__} is not an optimizer whose update is element-wise, so "
            f"sharding or mixed precision would change its update; use one of {names}, or "
            "strategy='ddp' with precision='fp32'")
    for state in optimizer.state.values():
        step = state.get("step", 0)
        if float(step) > 0 or (state and "step" not in state):
            raise ValueError("the optimizer has already stepped; call px.prepare before the first "
                             "optimizer.step(), and load a saved optimizer state after it")


def _init_state_for_masters(optimizer, masters) -> None:
    """Drop the state an optimizer made for the model's parameters at construction and make it
    for the masters instead (Adagrad creates its accumulators in __init__)."""
    optimizer.state.clear()
    if isinstance(optimizer, torch.optim.Adagrad):
        for group in optimizer.param_groups:
            for m in group["params"]:
                optimizer.state[m] = {
                    "step": torch.tensor(0.0),
                    "sum": torch.full_like(m, group["initial_accumulator_value"],
                                           memory_format=torch.preserve_format),
                }


def _optimizer_groups(optimizer, module, params) -> dict:
    """Map each trainable model parameter to its optimizer param group; every one must be in
    one, since the optimizer's params are about to be replaced by the shards' masters."""
    group_of = optimizer_groups(optimizer, module)
    missing = [p for p in params if p not in group_of]
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameter(s) of the model are not in the optimizer; add "
            "them, or set requires_grad=False on the ones you do not train")
    return group_of
