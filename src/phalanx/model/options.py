"""The options of `px.prepare`, checked alone and together in one place before any collective:
the same arguments fail alike on every rank, so no rank is left waiting for another.

`PrepareOptions.check(...)` is the only way one is made: it names the strategy (the alias
resolved: phalanx/strategies.py) and the precision (phalanx/precisions.py), checks each option
(most checks live beside what they configure: zero3's gathering in engine/units.py, staleness
in engine/delayed.py, PowerSGD in engine/powersgd_config.py, offload in engine/offload.py,
DiLoCo in model/diloco.py) and the table of combinations that do not go together (below, and
continue mode's refusals in continuing/). What depends on the world as well (`shard_size`) is
checked once the world is known (`shard_size_for`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm import continuation
from ..engine.delayed import check_staleness
from ..engine.hybrid import check_shard_size
from ..engine.offload import check_offload
from ..engine.powersgd_config import check_compression
from ..engine.units import check_gather_options
from ..faults.nonfinite import MODES as NONFINITE_MODES
from ..spec.precisions import precision_spec
from ..spec.strategies import strategy_name
from .diloco import check_diloco_options, split_strategy
from .precision import COMM_DTYPES

__all__ = ["PrepareOptions"]


@dataclass(frozen=True)
class PrepareOptions:
    """px.prepare's options after their checks: names resolved, defaults filled in."""

    strategy: str             # the engine's strategy ("ddp" under DiLoCo: its inner steps)
    precision: str
    bucket_mb: float
    comm_dtype: torch.dtype | None
    sync_batchnorm: bool
    broadcast_buffers: bool
    output_dtype: torch.dtype | None
    check_replicas_every: int | None
    on_nonfinite: str | None
    gather: dict              # zero3's gathering options (engine/units.py)
    max_gathered_mb: float | None
    staleness: int
    compression: object       # px.PowerSGD or None
    shard_size: object        # as given: resolved against the world by shard_size_for
    offload: str | None
    diloco: object            # px.DiLoCo or None
    step_stats: bool

    @classmethod
    def check(cls, optimizer, strategy, precision, *, bucket_mb, comm_dtype, sync_batchnorm,  # noqa: PLR0913
              broadcast_buffers, check_replicas_every, on_nonfinite, step_stats, prefetch,
              max_gathered_mb, reshard_after_forward, output_dtype, staleness, shard_size,
              compression, offload) -> PrepareOptions:
        """Every option alone, then together; a ValueError (or TypeError) that names the
        option and a value that works, raised on every rank alike."""
        diloco, strategy = split_strategy(strategy)
        strategy = strategy_name(strategy)
        precision = precision_spec(precision).name  # aliases resolved (phalanx/precisions.py)
        _check_bucket_mb(bucket_mb)
        _check_comm_dtype(comm_dtype)
        _check_replicas_every(check_replicas_every, strategy)
        check_diloco_options(diloco, optimizer, comm_dtype=comm_dtype,
                             sync_batchnorm=sync_batchnorm,
                             check_replicas_every=check_replicas_every)
        gather = check_gather_options(strategy, prefetch, max_gathered_mb, reshard_after_forward)
        staleness = check_staleness(staleness, strategy, precision)
        check_compression(compression, strategy, precision, comm_dtype)
        _check_combination(diloco, staleness, compression, shard_size)
        offload = check_offload(offload, strategy, diloco)
        continuation.check_options(strategy, precision, staleness, compression, diloco, shard_size)
        if output_dtype is not None and not (isinstance(output_dtype, torch.dtype)
                                             and output_dtype.is_floating_point):
            raise ValueError(f"output_dtype={output_dtype!r}: a floating dtype such as "
                             "torch.float32 (the default), or None to keep the compute dtype")
        if on_nonfinite not in NONFINITE_MODES:
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: one of 'raise' (the default), "
                             "'skip', 'warn' or None (no check)")
        return cls(strategy, precision, float(bucket_mb), comm_dtype, bool(sync_batchnorm),
                   bool(broadcast_buffers), output_dtype, check_replicas_every, on_nonfinite,
                   gather, max_gathered_mb, staleness, compression, shard_size, offload, diloco,
                   bool(step_stats))

    def shard_size_for(self, world: int) -> int | None:
        """The shard group's size in a world of `world` ranks (None: all of them)."""
        return check_shard_size(self.shard_size, self.strategy, world, self.staleness)

    def compared(self, shard_size, block_classes) -> dict:
        """What every rank must have alike (model/consistency.py compares it), and what
        `px.prepare` was asked, in its own words."""
        return {"strategy": self.strategy, "precision": self.precision,
                "bucket_mb": self.bucket_mb, "comm_dtype": COMM_DTYPES[self.comm_dtype],
                "sync_batchnorm": self.sync_batchnorm,
                "broadcast_buffers": self.broadcast_buffers, "output_dtype": self.output_dtype,
                "check_replicas_every": self.check_replicas_every,
                "on_nonfinite": self.on_nonfinite, **self.gather, "staleness": self.staleness,
                "shard_size": shard_size, "compression": self.compression,
                "offload": self.offload,
                "blocks": None if block_classes is None else [c.__name__ for c in block_classes],
                "diloco": self.diloco}


def _check_bucket_mb(bucket_mb) -> None:
    if not (isinstance(bucket_mb, (int, float)) and not isinstance(bucket_mb, bool)
            and math.isfinite(bucket_mb) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a positive, finite number of MiB (default "
                         f"25), not {bucket_mb!r}")


def _check_comm_dtype(comm_dtype) -> None:
    try:
        ok = comm_dtype in COMM_DTYPES
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"comm_dtype must be None, torch.bfloat16, torch.float16 or "
                         f"torch.float32 (or 'bf16', 'fp16', 'fp32'), not {comm_dtype!r}")


def _check_replicas_every(every, strategy: str) -> None:
    if every is None:
        return
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"check_replicas_every={every!r}: a number of optimizer steps, 1 or "
                         "more, or None (no check)")
    if strategy == "zero3":
        raise ValueError("check_replicas_every compares whole parameters, which zero3 never "
                         "keeps between steps; use it with ddp, zero1 or zero2")


def _check_combination(diloco, staleness, compression, shard_size) -> None:
    """The ways to communicate less that do not combine, refused by name on every rank."""
    if staleness and diloco is not None:
        raise ValueError("staleness=1 delays each step's gradient average, and DiLoCo averages "
                         "no gradients between its syncs: use one of them, not both")
    if diloco is not None and shard_size is not None:
        raise ValueError("shard_size shards zero1/zero2/zero3 state within groups; DiLoCo's "
                         "inner steps are replicated and local: leave shard_size out")
    if compression is None:
        return
    if diloco is not None:
        raise ValueError("compression=PowerSGD compresses each step's gradient average, and "
                         "DiLoCo averages no gradients between its syncs: use one of them")
    if staleness:
        raise ValueError("compression=PowerSGD with staleness=1 is not supported: the delayed "
                         "average sends the bucket whole; use one of them")
    if shard_size is not None:
        raise ValueError("compression=PowerSGD with shard_size is not supported: the average "
                         "across shard groups is sent whole; leave shard_size out or compression")
