"""The options of `px.prepare` checked alone and together, before any collective: the same
arguments fail alike on every rank, so no rank is left waiting for another."""

from __future__ import annotations

import math

from ..precisions import precision_spec
from .precision import COMM_DTYPES

__all__ = ["STRATEGIES"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def _check_options(strategy, precision, bucket_mb, comm_dtype, check_replicas_every):
    if not isinstance(strategy, str) or strategy.lower() not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of "
                         "'ddp', 'zero1', 'zero2', 'zero3' (alias 'fsdp')")
    strategy = {"fsdp": "zero3"}.get(strategy.lower(), strategy.lower())
    if strategy == "zero3" and check_replicas_every is not None:
        raise ValueError("check_replicas_every compares whole parameters, which zero3 never "
                         "keeps between steps; use it with ddp, zero1 or zero2")
    precision = precision_spec(precision).name  # aliases resolved (phalanx/precisions.py)
    if not (isinstance(bucket_mb, (int, float)) and not isinstance(bucket_mb, bool)
            and math.isfinite(bucket_mb) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a positive, finite number of MiB (default "
                         f"25), not {bucket_mb!r}")
    try:
        ok = comm_dtype in COMM_DTYPES
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"comm_dtype must be None, torch.bfloat16, torch.float16 or "
                         f"torch.float32 (or 'bf16', 'fp16', 'fp32'), not {comm_dtype!r}")
    if check_replicas_every is not None and (isinstance(check_replicas_every, bool) or not
                                             isinstance(check_replicas_every, int)
                                             or check_replicas_every < 1):
        raise ValueError(f"check_replicas_every={check_replicas_every!r}: a number of optimizer "
                         "steps, 1 or more, or None (no check)")
    return strategy, precision


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
