"""What every collective leaves behind, and where the step report, the hang watcher and the
planner's check read it.

Each `Comm` (collectives.py) writes a `CollectiveRecord` for every collective it issues: kind,
payload bytes, tag, the name of its process group and its number there, the optimizer step of
the model it serves, and its start, completion and waited times. The live Comms are kept in
this module's part of the process state (process.py; weakly: a Comm that nobody holds any more
drops out), behind a lock here, because they are read from other threads than the training
thread: the hang watcher's (faults/hangs.py) and a background save's.

[Note: groups by name]
A process group is known to every rank by the same name ("world" for the job's group,
"zero3:gathers", "checkpoint:saves", ...), given by whoever made the group (groups.py). The hang
report compares the ranks' records group by group, by that name and the collective's number on
the group, since a group's object is not the same thing on two processes.

[Note: steps per model]
Every prepared model counts its own optimizer steps (a `StepCounter` that its engine ticks), and
its Comms stamp that count on their records, so two prepared models (a GAN's two networks) do
not double each other's step. Where no model is named (`px.log` without a step, a hang report
over every group), the step is the largest count of any live model.

[Note: records in flight]
A record whose completion is polled (NCCL: see [Note: completion on NCCL] in completion.py) is
also kept in its Comm's `in_flight` list from its issue until it is seen complete, and every
`poll_completions` polls all of those, whichever records it was handed: the hang watcher hands
it only each group's newest 64 records, so a record left pending behind more newer ones than
that (one not yet complete at its wait and at its step's end) is still polled at every tick and
stamped when its work completes, never left in flight to raise a false hang report. The cost is
that of the records in flight, not of the history; the list is changed under the lock, since
the watcher's thread drops from it what the training thread appends to.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from ..world.process import state

__all__ = ["CollectiveRecord", "StepCounter", "register", "live", "next_seq", "current_step",
           "blocking_done", "note_blocking_done", "on_blocking_done",
           "records_on", "records_since", "groups_in_use", "bytes_by_kind", "reset_counts",
           "close_all", "poll_completions", "add_in_flight", "drop_in_flight"]


@dataclass
class CollectiveRecord:
    seq: int                     # this Comm's count of collectives
    kind: str
    nbytes: int
    tag: str | None
    started: float               # time.perf_counter() when issued
    completed: float | None = None  # when the work completed (None while in flight)
    group_seq: int = 0           # the count on its process group, over every Comm of it
    step: int = 0                # optimizer steps the model it serves had taken when issued
    waited: float = 0.0          # seconds the issuing thread was blocked waiting for it
    group: str = "world"         # the group's name: see [Note: groups by name]
    # Works whose completion is polled rather than signalled (NCCL; see collectives.py),
    # dropped once complete.
    pending: list = field(default_factory=list, repr=False)
    # NCCL: two CUDA events around the wait on the current stream (how long compute stalled).
    stall: tuple | None = field(default=None, repr=False)

    def exposed(self) -> float:
        """Seconds the training waited for this collective: the host's wait, or on NCCL the
        stream's stall between the events once they have completed (0 until then)."""
        if self.stall is None:
            return self.waited
        start, end = self.stall
        try:
            if end.query():
                return start.elapsed_time(end) / 1e3
        except RuntimeError:
            pass
        return 0.0

    def poll(self, now: float | None = None) -> bool:
        """Stamp the completion time if every pending work has completed (a non-blocking query
        of the device on NCCL); True when complete."""
        if self.completed is not None:
            return True
        if not self.pending:
            return False
        try:
            done = all(w.is_completed() for w in self.pending)
        except RuntimeError:  # the work failed: the waiting thread raises it
            done = True
        if done:
            self.completed = now if now is not None else time.perf_counter()
            self.pending = []
        return done


class StepCounter:
    """One prepared model's optimizer steps (see [Note: steps per model])."""

    def __init__(self):
        self.value = 0
        with _lock:
            state.records.counters.add(self)

    def tick(self) -> None:
        self.value += 1


# Guards state.records (process.py), read by the hang watcher's and background saves' threads.
# state.records.group_seq counts the collectives issued on each process group (by id), over
# all the Comms that share it: every rank issues the same sequence on a group, so this number
# names one collective on every rank. state.records.blocking_done counts the blocking
# collectives that returned, per process group (by id): when one that was issued after a
# moment has returned on this rank, every rank of the group has issued it, so each has
# finished what its main thread did before it (engine/remote.py releases dropped models then).
_lock = threading.Lock()


def blocking_done(group) -> int:
    """How many blocking collectives on `group` have returned on this rank so far."""
    return state.records.blocking_done[id(group)]


def note_blocking_done(group) -> None:
    """A blocking collective on `group` returned (collectives.py); tell who asked."""
    state.records.blocking_done[id(group)] += 1
    for fn in list(state.records.on_blocking_done):
        fn(group)


def on_blocking_done(fn) -> None:
    if fn not in state.records.on_blocking_done:
        state.records.on_blocking_done.append(fn)


def register(comm) -> None:
    with _lock:
        state.records.live.add(comm)


def live() -> list:
    """The live Comms, copied under the lock (another thread may be making one)."""
    with _lock:
        return list(state.records.live)


def next_seq(group) -> int:
    with _lock:
        seq = state.records.group_seq
        seq[id(group)] += 1
        return seq[id(group)]


def current_step() -> int:
    """The largest step count of any live prepared model (0 before any)."""
    with _lock:
        counters = list(state.records.counters)
    return max((c.value for c in counters), default=0)


def records_on(group) -> list[CollectiveRecord]:
    """The recent records of every live `Comm` over `group`, in the group's order."""
    if group is None:
        return []
    out = [rec for comm in live() if comm.group is group for rec in list(comm.records)]
    return sorted(out, key=lambda rec: rec.group_seq)


def records_since(groups, since: float) -> list[CollectiveRecord]:
    """The records over any of `groups` of collectives issued at or after `since`
    (perf_counter), read from the newest backwards, so the cost is that of the records
    returned."""
    wanted = {id(g) for g in groups if g is not None}
    out = []
    for comm in live():
        if id(comm.group) not in wanted:
            continue
        for rec in reversed(comm.records):
            if rec.started < since:
                break
            out.append(rec)
    return out


def groups_in_use() -> dict[str, object]:
    """name -> process group, for every group a live Comm issues on (the hang watcher's)."""
    return {comm.name: comm.group for comm in live() if comm.group is not None}


def add_in_flight(comm, rec: CollectiveRecord) -> None:
    """Keep `rec`, whose works `comm` polls, in flight until seen complete."""
    with _lock:
        comm.in_flight.append(rec)


def drop_in_flight(comm) -> None:
    with _lock:
        comm.in_flight = []


def poll_completions(records) -> None:
    """Stamp the completion of those records whose works have completed since they were
    issued (see `CollectiveRecord.poll`), and of every record in flight on any live Comm,
    dropping those complete (see [Note: records in flight])."""
    now = time.perf_counter()
    for rec in records:
        if rec.completed is None and rec.pending:
            rec.poll(now)
    for comm in live():
        with _lock:
            in_flight = list(comm.in_flight)
        if not in_flight:
            continue
        for rec in in_flight:
            rec.poll(now)
        with _lock:
            comm.in_flight = [rec for rec in comm.in_flight if rec.completed is None]


def bytes_by_kind() -> dict[str, int]:
    """Payload bytes by collective kind, summed over every live `Comm` of this process (what
    the planner's communication figures are checked against)."""
    total: dict[str, int] = defaultdict(int)
    for comm in live():
        for kind, n in comm.bytes_by_kind.items():
            total[kind] += n
    return dict(total)


def reset_counts() -> None:
    for comm in live():
        comm.reset_counts()


def close_all() -> None:
    """Make every live `Comm` drop its group (called by `px.shutdown()` before the groups are
    destroyed, so no engine keeps one alive into interpreter finalisation)."""
    for comm in live():
        comm.close()
