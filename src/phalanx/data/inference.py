"""`px.map_batches`: data-parallel batch inference over a list of items.

    captions = px.map_batches(lambda images: model.generate(images), images, batch_size=16)

[Note: who runs which batch]
By default (`schedule="dynamic"`) the batches are handed out as ranks become free: each rank
takes the next batch number from a counter on the job's rendezvous store (one atomic add, a
round trip to rank 0's store per batch) until none are left, so a rank that drew slow items
(long generations) takes fewer batches and no rank waits idle while another works through a
long block. With `schedule="static"` the items are split into contiguous, as-even-as-possible
blocks in rank order (shares differ by at most one item) and no store is used. Either way one
gather at the end puts all results back in the items' order, every rank makes exactly the same
collectives whatever its share (so an uneven split cannot hang), and a failure in `fn` on any
rank (or a wrong number of results) is raised on every rank, naming the rank, instead of
leaving the others waiting. The collectives go through the job's default `Comm`, tagged
"map_batches:status" (the outcome of every rank) and "map_batches" (the results).
"""

from __future__ import annotations

import collections.abc as abc
import traceback

import torch.distributed as dist

from ..world.runtime import default_comm
from .sampler import check_batch_size, split_evenly

__all__ = ["map_batches"]

SCHEDULES = ("dynamic", "static")
_calls = [0]  # map_batches calls made by this process: every rank makes the same ones


def map_batches(fn, items, batch_size: int, *, main_only: bool = False,
                schedule: str = "dynamic"):
    """`fn(list_of_items) -> list_of_results` over all items, shared across ranks (a collective).

    Returns one result per item, in the items' order, on every rank; with `main_only=True`
    only rank 0 receives them (the others get None), which saves memory on large outputs.
    Every rank must pass the same items. `schedule` says who runs which batch: "dynamic" (the
    default) hands the batches out as ranks become free (a counter on the job's rendezvous
    store, one round trip per batch), so a rank that drew slow items takes fewer batches and
    none waits idle while another works through a long block; "static" splits the items into
    contiguous, as-even-as-possible blocks in rank order. Either way every rank makes the same
    collectives whatever its share, so an uneven split cannot hang, and a failure in `fn` on
    any rank (or a wrong number of results) is raised on every rank, naming the rank.
    """
    # The mechanism: [Note: who runs which batch] above.
    check_batch_size(batch_size)
    if schedule not in SCHEDULES:
        raise ValueError(f"px.map_batches(schedule={schedule!r}): use 'dynamic' (batches to "
                         "whichever rank is free) or 'static' (contiguous blocks in rank order)")
    if not isinstance(items, abc.Sequence):
        items = list(items)
    comm = default_comm()
    world, rank = comm.world, comm.rank
    if comm.group is None:
        return _run(fn, items, 0, len(items), batch_size)
    _calls[0] += 1
    store = _store() if schedule == "dynamic" else None
    try:
        if store is not None:
            done, status = _run_dynamic(fn, items, batch_size, store,
                                        f"phalanx/map_batches/{_calls[0]}"), None
        else:
            lo, hi = split_evenly(len(items), world, rank)
            results = _run(fn, items, lo, hi, batch_size)
            done, status = ({lo: results} if results else {}), None
    except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised here with its cause
        done, status = None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        error = exc
    statuses = comm.all_gather_object((len(items), status), tag="map_batches:status")
    lengths = {n for n, _ in statuses}
    failed = {r: s for r, (_, s) in enumerate(statuses) if s is not None}
    if failed:
        text = "\n".join(f"--- rank {r}:\n{s}" for r, s in sorted(failed.items()))
        message = f"px.map_batches: fn failed on rank(s) {sorted(failed)}\n{text}"
        if rank in failed:
            raise RuntimeError(message) from error
        raise RuntimeError(message)
    if len(lengths) > 1:
        raise ValueError(f"px.map_batches: ranks passed different numbers of items "
                         f"{[n for n, _ in statuses]}; every rank must pass the same items")
    if main_only:
        parts = comm.gather_object(done, dst=0, tag="map_batches")
        return _in_order(parts) if rank == 0 else None
    return _in_order(comm.all_gather_object(done, tag="map_batches"))


def _store():
    """The job's rendezvous store (None where torch keeps none for the default group)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _run_dynamic(fn, items, batch_size: int, store, key: str) -> dict[int, list]:
    """Take batch numbers from the store's counter until none are left; {batch: results}."""
    batches = (len(items) + batch_size - 1) // batch_size
    done = {}
    while True:
        b = store.add(key, 1) - 1
        if b >= batches:
            return done
        start = b * batch_size
        done[start] = _run(fn, items, start, min(start + batch_size, len(items)), batch_size)


def _in_order(parts: list[dict[int, list]]) -> list:
    """Every rank's {first item: results} put back in the items' order."""
    merged = {start: results for part in parts for start, results in part.items()}
    return [r for start in sorted(merged) for r in merged[start]]


def _run(fn, items, lo: int, hi: int, batch_size: int) -> list:
    results = []
    for start in range(lo, hi, batch_size):
        batch = [items[i] for i in range(start, min(start + batch_size, hi))]
        out = fn(batch)
        try:
            out = list(out)
        except TypeError:
            raise TypeError(f"px.map_batches: fn must return a list of results, one per item; "
                            f"got {type(out).__name__}") from None
        if len(out) != len(batch):
            raise ValueError(f"px.map_batches: fn returned {len(out)} results for a batch of "
                             f"{len(batch)} items; it must return one result per item")
        results.extend(out)
    return results
