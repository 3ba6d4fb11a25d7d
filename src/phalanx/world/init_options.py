"""`px.init`'s arguments, checked before anything is joined: a bad value raises an error that
names the option and a value that works."""

from __future__ import annotations

import datetime
import math

from .environment import backend_name

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
    """A backend this torch has and this machine can use (environment.backend_name)."""
    if backend is None:
        return
    if not isinstance(backend, str):
        raise TypeError(f"px.init(backend=...) takes a name such as 'gloo' or 'nccl', or None "
                        f"to choose; got {type(backend).__name__} {backend!r}")
    try:
        backend_name(backend)
    except ValueError as exc:
        raise ValueError(f"px.init(backend={backend!r}): {exc}") from None
