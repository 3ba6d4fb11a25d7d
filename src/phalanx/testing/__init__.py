"""Run a function on N real processes (CPU, gloo) and collect what each rank returns.

This is the harness every multi-process test uses:

    results = run_ranks(fn, world_size=3, args=(...), timeout=60)

It is `px.spawn`'s mechanism (launch/spawn.py) with what tests want: every rank's return value, a
file rendezvous (no ports, so parallel test runs never collide), forked ranks (a forked rank
starts in milliseconds where a spawned one re-imports torch, seconds on two cores) with one
intra-op thread each, and a timeout always. It raises `RanksFailed` with the traceback of every
rank that raised, and, when the run outlives `timeout`, `RanksTimedOut` with the Python stack
of every rank that was still running (taken with faulthandler before the rank is killed). A
dead or stuck rank therefore fails the test within a second or two of its timeout; it never
hangs the suite.

`engine_of(model)` is the one documented way for a test to look inside a prepared model (its
units, buckets and zero3 gatherer, engine/); nothing else of phalanx's internals is a test's to
reach into.
"""

from __future__ import annotations

from ..launch.spawn import SpawnError, SpawnTimeout, run_workers
from ..model.prepare import prepared_or_none

__all__ = ["run_ranks", "RanksFailed", "RanksTimedOut", "engine_of"]


class RanksFailed(SpawnError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class RanksTimedOut(SpawnTimeout):
    """The ranks did not finish in time; the message holds the stacks of the stuck ones."""


def run_ranks(fn, world_size: int, args=(), kwargs=None, timeout: float = 120.0, threads: int = 1):
    """Run `fn(*args, **kwargs)` on `world_size` processes; return the list of results by rank."""
    try:
        return run_workers(fn, world_size, args, kwargs, timeout=timeout, threads=threads,
                           rendezvous="file", start_method="fork")
    except SpawnTimeout as exc:
        raise RanksTimedOut(str(exc), exc.ranks) from None
    except SpawnError as exc:
        raise RanksFailed(str(exc), exc.ranks) from None


def engine_of(model):
    """The engine behind a prepared model (or `torch.compile` of one): the `Engine` of
    engine/__init__.py, for tests that count what it holds; None for a model not prepared."""
    inner = prepared_or_none(model)
    return inner._engine if inner is not None else None
