"""`px.prepare` and the verbs that act on a prepared model.

    model, optimizer = px.prepare(model, optimizer, strategy="ddp", precision="fp32")

The order of what prepare does matters, and is the same on every rank:
  1. check the names (strategy, precision, options) before any collective, so a typo fails
     on every rank alike without anyone waiting for anyone;
  2. move the model to this rank's device and, if asked, convert BatchNorm to its
     synchronized form (parameters keep their identity, so the optimizer still holds them);
  3. compare the model's structure across ranks (consistency.py), then broadcast rank 0's
     parameters and buffers;
  4. build the strategy's engine: `Replicated` for fp32 ddp, the flat-shard engine
     `Sharded` for zero1/zero2 and for ddp with low-precision compute;
  5. wrap the module so forward keeps buffers in sync and applies the precision policy.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from . import runtime
from .consistency import broadcast_from_rank0, check_same_structure, optimizer_groups
from .loss_scaling import DynamicLossScaler
from .replicate import Replicated
from .sharding import POLICIES, Sharded
from .wrapper import PreparedModule

__all__ = ["prepare", "unwrap", "no_sync", "clip_grad_norm_", "STRATEGIES", "PRECISIONS"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMM_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32)


def _check_options(strategy, precision, bucket_mb, comm_dtype):
    if not isinstance(strategy, str) or strategy.lower() not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of "
                         "'ddp', 'zero1', 'zero2', 'zero3' (alias 'fsdp')")
    strategy = strategy.lower()
    if strategy in ("zero3", "fsdp"):
        raise NotImplementedError(
            "strategy 'zero3' (parameter sharding) is not available in this version; use "
            "'zero2' (gradients and optimizer state sharded) or 'ddp'")
    if not isinstance(precision, str) or precision.lower() not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of 'fp32', 'bf16', 'fp16'")
    if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a positive number of megabytes, not {bucket_mb!r}")
    if isinstance(comm_dtype, str):
        comm_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
            comm_dtype, comm_dtype)
    if comm_dtype not in COMM_DTYPES:
        raise ValueError(f"comm_dtype must be None, torch.bfloat16 or torch.float16, "
                         f"not {comm_dtype!r}")
    return strategy, precision.lower(), comm_dtype


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            strategy: str = "ddp", precision: str = "fp32", *, bucket_mb: float = 25.0,
            comm_dtype: torch.dtype | None = None, sync_batchnorm: bool = False,
            broadcast_buffers: bool = True):
    """Wrap `model` (and `optimizer`) for data-parallel training; returns `(model, optimizer)`.

    strategy: "ddp" (replicated), "zero1" (optimizer state sharded), "zero2" (and gradients).
    precision: "fp32", or "bf16"/"fp16" compute with fp32 master weights (fp16 with dynamic
        loss scaling). Low precision also communicates in that dtype unless `comm_dtype` says.
    bucket_mb: cap of a gradient bucket, in MiB (the first bucket is at most 1 MiB).
    comm_dtype: torch.bfloat16 / torch.float16 to compress gradient communication.
    sync_batchnorm: BatchNorm statistics over all ranks (CPU and GPU).
    broadcast_buffers: keep buffers equal to rank 0's before each training forward.

    After prepare the ordinary loop works and gradients are the mean over ranks.
    """
    strategy, precision, comm_dtype = _check_options(strategy, precision, bucket_mb, comm_dtype)
    if isinstance(model, PreparedModule):
        raise ValueError("this model was already prepared; call px.prepare once per model")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"px.prepare expects a torch.nn.Module, not {type(model).__name__}")
    runtime.init()
    group = runtime.default_group()
    model.to(runtime.device())
    if sync_batchnorm:
        from .sync_batchnorm import convert_sync_batchnorm
        model = convert_sync_batchnorm(model, group=group)
    if optimizer is not None:
        optimizer_groups(optimizer, model)
    check_same_structure(model, group)
    broadcast_from_rank0(model, group)

    compute_dtype = PRECISIONS[precision]
    if compute_dtype != torch.float32 and comm_dtype is None:
        comm_dtype = compute_dtype
    loss_scaler = DynamicLossScaler() if precision == "fp16" else None
    if strategy == "ddp" and precision == "fp32":
        engine = Replicated(model, group, bucket_mb=bucket_mb, comm_dtype=comm_dtype) \
            if group is not None else None
    else:
        engine = Sharded(model, optimizer, group, POLICIES[strategy], compute_dtype=compute_dtype,
                         comm_dtype=comm_dtype, bucket_mb=bucket_mb, loss_scaler=loss_scaler)
    wrapped = PreparedModule(model, engine, group, broadcast_buffers=broadcast_buffers,
                             compute_dtype=compute_dtype, loss_scaler=loss_scaler)
    return wrapped, optimizer


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's original module inside a prepared model (the model itself otherwise)."""
    return model.module if isinstance(model, PreparedModule) else model


def _engine(model):
    if not isinstance(model, PreparedModule):
        raise TypeError("expected the model returned by px.prepare")
    return model._engine


def no_sync(model: torch.nn.Module):
    """Context for accumulation micro-steps: backward inside it communicates nothing; the next
    backward outside it averages everything accumulated."""
    engine = _engine(model)
    return engine.reducer.no_sync() if engine is not None else nullcontext()


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm over all ranks and shards; returns that norm."""
    engine = _engine(model)
    if engine is None:
        return torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.grad is not None], max_norm, norm_type=norm_type)
    return engine.clip_grad_norm_(max_norm, norm_type)
