"""`px.map_batches`: data-parallel batch inference over a list of items.

    captions = px.map_batches(lambda images: model.generate(images), images, batch_size=16)

The items are split into contiguous, as-even-as-possible blocks in rank order (shares differ
by at most one item, so any length works, including fewer items than ranks); each rank runs
`fn` on its block in batches of `batch_size`, and one gather at the end puts all results back
in the items' order. Every rank makes exactly the same collectives whatever its share, so an
uneven split cannot hang. A failure in `fn` on any rank (or a wrong number of results) is
raised on every rank, naming the rank, instead of leaving the others waiting. The collectives
go through the job's default `Comm`, tagged "map_batches:status" (the outcome of every rank)
and "map_batches" (the results).
"""

from __future__ import annotations

import collections.abc as abc
import traceback

from ..collectives import default_comm
from .sampler import check_batch_size, split_evenly

__all__ = ["map_batches"]


def map_batches(fn, items, batch_size: int, *, main_only: bool = False):
    """`fn(list_of_items) -> list_of_results` over all items, shared across ranks (a collective).

    Returns one result per item, in the items' order, on every rank; with `main_only=True`
    only rank 0 receives them (the others get None), which saves memory on large outputs.
    Every rank must pass the same items.
    """
    check_batch_size(batch_size)
    if not isinstance(items, abc.Sequence):
        items = list(items)
    comm = default_comm()
    world, rank = comm.world, comm.rank
    lo, hi = split_evenly(len(items), world, rank)
    if comm.group is None:
        return _run(fn, items, lo, hi, batch_size)

    try:
        results, status = _run(fn, items, lo, hi, batch_size), None
    except Exception as exc:  # reported to every rank below, then raised here with its cause
        results, status = None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
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
        parts = comm.gather_object(results, dst=0, tag="map_batches")
        return [r for part in parts for r in part] if rank == 0 else None
    return [r for part in comm.all_gather_object(results, tag="map_batches") for r in part]


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
