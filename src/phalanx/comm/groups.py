"""Every process group phalanx makes beside the job's own: made once per purpose, bounded by
the job's timeout, ended at `px.shutdown()`.

Some collectives must not share a sequence with the training's: zero3's gathers run on a group
of their own ([Note: two sequences of collectives] in engine/zero3.py), and so do a background
save's writes (checkpoint/saving.py), which run in another thread. Each such group is made once
per (parent group, purpose) by the ranks of the parent group, and shared by every later user of
that purpose: each user issues the same collectives on every rank, so one sequence holds them
all, and preparing model after model adds no groups. Each is made with `px.init`'s timeout,
so a collective waiting on it is bounded like one on the job's group, and each is named (see
[Note: groups by name] in records.py) so that the hang watcher and the step report, which read
every live `Comm`, see its traffic too.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ..world.process import state

__all__ = ["set_timeout", "timeout", "group_for", "partition", "end_all", "forget_all", "made",
           "on_end"]


def set_timeout(value: datetime.timedelta | None) -> None:
    state.groups.timeout = value


def timeout() -> datetime.timedelta | None:
    """The job's collective timeout (`px.init(timeout=)`), or None before `px.init`."""
    return state.groups.timeout


def group_for(parent, purpose: str, backend: str | None = None):
    """The process group for `purpose` over the ranks of `parent` (made the first time: a
    collective of those ranks)."""
    key = (id(parent), purpose)
    entry = state.groups.made.get(key)
    if entry is None or entry[0] is not parent:
        kwargs = {"timeout": timeout()} if timeout() is not None else {}
        group = dist.new_group(dist.get_process_group_ranks(parent), backend=backend,
                               use_local_synchronization=True, **kwargs)
        entry = state.groups.made[key] = (parent, group)
    return entry[1]


def partition(parent, size: int) -> tuple:
    """(the group of `size` consecutive ranks of `parent` holding this rank, the group of the
    ranks at this rank's position in every such group): hybrid sharding's two groups
    (hybrid.py). Every rank of `parent` makes every one of them, in one order (torch asks each
    rank to take part in making every group of a partition), once per (parent, size)."""
    key = (id(parent), f"hybrid:{size}")
    entry = state.groups.made.get(key)
    if entry is None or entry[0] is not parent:
        ranks = dist.get_process_group_ranks(parent)
        me = ranks.index(dist.get_rank())
        kwargs = {"timeout": timeout()} if timeout() is not None else {}
        blocks = [ranks[g:g + size] for g in range(0, len(ranks), size)]
        columns = [ranks[i::size] for i in range(size)]
        made = [dist.new_group(r, **kwargs) for r in blocks + columns]
        shards, replicas = made[me // size], made[len(blocks) + me % size]
        state.groups.made[(id(parent), f"hybrid:{size}:replicas")] = (parent, replicas)
        entry = state.groups.made[key] = (parent, shards)
    return entry[1], state.groups.made[(id(parent), f"hybrid:{size}:replicas")][1]


def made() -> list:
    """The groups made so far (for tests: every one must be bounded and ended)."""
    return [group for _, group in state.groups.made.values()]


def on_end(fn) -> None:
    """Have `end_all` call `fn()` before it destroys the groups (what still uses them stops)."""
    if fn not in state.groups.on_end:
        state.groups.on_end.append(fn)


def end_all() -> None:
    """Destroy every group made here (`px.shutdown()`, before the job's group), after calling
    what `on_end` registered."""
    for fn in list(state.groups.on_end):
        fn()
    entries, _ = list(state.groups.made.values()), state.groups.made.clear()
    for _, group in entries:
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):  # already gone with its parent
            pass


def forget_all() -> None:
    """Forget every group made here without destroying them one by one: the job's group is
    being destroyed with all of its subgroups (a generation ends, continuing/membership.py).
    What `on_end` registered stops first, as at `end_all`."""
    for fn in list(state.groups.on_end):
        fn()
    state.groups.made.clear()
