"""`px.init`'s arguments, checked before anything is joined: a bad value raises an error that
names the option and a value that works."""

from __future__ import annotations

import datetime
import math

import torch

__all__ = ["check_timeout", "check_backend"]


def check_timeout(timeout) -> datetime.timedelta:
    """`timeout` as a timedelta, or a TypeError/ValueError that names the option."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"px.init(timeout=...) takes a number of seconds (int or float), got "
                        f"{type(timeout).__name__} {timeout!r}; for example timeout=600")
    try:
        if math.isfinite(seconds) and seconds > 0:
            return datetime.timedelta(seconds=seconds)
    except OverflowError:  # beyond what a timedelta holds (about 2.7 million years)
        pass
    raise ValueError(f"px.init(timeout={timeout!r}): the timeout bounds every collective and "
                     "must be a positive, finite number of seconds; for example timeout=600 "
                     "(the default)")


def check_backend(backend) -> None:
    if backend is None:
        return
    if not isinstance(backend, str):
        raise TypeError(f"px.init(backend=...) takes a name such as 'gloo' or 'nccl', or None "
                        f"to choose; got {type(backend).__name__} {backend!r}")
    if backend.lower() == "nccl" and not torch.cuda.is_available():
        raise ValueError("px.init(backend='nccl'): NCCL needs CUDA GPUs, and this process sees "
                         "none (torch.cuda.is_available() is False); use backend='gloo', the "
                         "CPU backend, or leave backend=None to pick the one that fits")
