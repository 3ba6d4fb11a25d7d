"""The hang report: when a collective has waited too long, find out why, say it, end the job.

A data-parallel job hangs when the ranks stop issuing the same collectives: one rank is stuck
or slow outside any collective, skipped one, issued an extra one, ran fewer steps, or issued
them in another order. Each rank then waits in a collective its peers never join, until the
process group's timeout (minutes), and the error says nothing about which rank or why.

Here every rank runs a watcher thread. Every collective phalanx issues is recorded by its
`Comm` before it is issued and marked complete when its work completes (collectives.py,
records.py), with its process group's name and its number there, kind, tag (which bucket or
unit, or which helper) and the optimizer step. The watcher wakes every `poll` seconds, reads
the records of every group a live Comm issues on (the job's, zero3's gathers, background
saves': no collective, no synchronisation with the training thread) and looks at one key of
the rendezvous store. When a collective of this rank has been in flight for longer than the
threshold, the watcher raises the flag in the store; every rank's watcher, seeing it, writes
its recent records and the Python stack of its main thread to the store; the rank that raised
the flag compares them, on the group where a collective has waited longest, and prints one
message that names what differs, such as

    hang at step 12: rank 1 has not entered all_reduce #58 (unit[3]:grads); rank 0 has
    waited 31 s in it

followed by each rank's last collectives and stack. Then every rank ends with exit status
`HANG_EXIT`, long before the process group's own timeout would have ended it.

The threshold is derived from `px.init(timeout=...)` (a third of it, see `hang_threshold`), so
the report fires first and the process group's timeout remains the backstop; a rank that is
only slow (evaluating alone while the others wait at a barrier) for longer than that is
reported as a hang too, and the message says how to give it more time. A peer that has reached
its end (leaving.py: its script ended, or it called px.shutdown(), while this rank goes on)
will never come: a collective that waits on such a peer raises the flag after `EARLY_POLLS`
polls instead of the threshold, and the report says that rank left early.

Under `phalanx run --on-failure continue` the job does not end when the report names the
ranks it waits for: see [Note: a member that hangs] in continuing/membership.py. Those ranks are
removed (their launchers end them), and the others go on as after a kill.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
import traceback

import torch.distributed as dist

from ..comm import records
from ..world import environment, leaving
from .hang_report import HangReport, compose_report, ranks_text
from .store_calls import BoundedStore, StoreSilent

__all__ = ["HangWatch", "HANG_EXIT", "hang_threshold", "compose_report", "HangReport"]

HANG_EXIT = 124          # the exit status of every rank of a job ended by a hang report
EARLY_POLLS = 3          # polls a collective waits on a peer that has reached its end
_KEY = "phalanx/hang"
_ANSWER_WAIT = 10.0      # how long the reporter waits for the other ranks' states (seconds)


def hang_threshold(timeout_s: float) -> float | None:
    """Seconds a collective may wait before the hang report: PHALANX_HANG_AFTER if set ("off":
    no watcher, None), else a third of the collective timeout, so the report comes before the
    timeout's bare error."""
    seconds = environment.value("PHALANX_HANG_AFTER")  # False: "off"; None: unset
    if seconds is False:
        return None
    return timeout_s / 3 if seconds is None else seconds


def _main_stack(limit: int = 8) -> list[str]:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    out = []
    for summary in traceback.extract_stack(frame)[-limit:]:
        out.append(f"{summary.filename}:{summary.lineno} in {summary.name}: "
                   f"{(summary.line or '').strip()}")
    return out


def _oldest_in_flight(records):
    return next((r for r in records if r.completed is None), None)


def _as_dict(rec, now: float) -> dict:
    return {"group_seq": rec.group_seq, "kind": rec.kind, "tag": rec.tag, "step": rec.step,
            "done": rec.completed is not None, "age": now - rec.started}


class HangWatch:
    """The watcher thread of one rank (see the module's docstring)."""

    def __init__(self, store, rank: int, world: int, threshold: float, poll: float | None = None):
        self.rank, self.world = rank, world
        self.threshold = threshold
        self.poll = poll if poll is not None else min(1.0, threshold / 4)
        # Every look at the store is bounded: see [Note: a store that does not answer]
        self.store = BoundedStore(store, patience=max(2.0, 2 * self.poll))
        # A key space per job attempt and per px.init: under a launcher whose store outlives a
        # restart, the counter goes on, so an old attempt's flag is never read as a new one's.
        attempt = (store.add(f"{_KEY}/joined", 1) - 1) // world
        self.prefix = f"{_KEY}/{attempt}"
        self.members: dict[str, list[int]] = {}  # a group of some ranks only -> its ranks
        self.on_tick = None  # fn(name -> oldest collective in flight or None), every tick
        # Under continue mode (continuing/): fn(ranks the report names) has them removed, and the
        # job goes on without them; fn([]): the job ends. See [Note: a member that hangs].
        self.on_hang = None
        self.settled = False  # a report named others, being removed: nothing more to report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.store.close()

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        warned = False
        while not self._stop.wait(self.poll):
            try:
                self._tick()
            except dist.DistError:  # the store went away (a peer ended the job): stop watching
                return
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the watching
                if not warned:
                    warned = True
                    print(f"phalanx: rank {self.rank}: the hang watcher met an error and goes "
                          f"on watching: {type(exc).__name__}: {exc}", file=sys.stderr,
                          flush=True)

    def _groups(self) -> dict[str, list]:
        """name -> records, for every group a live Comm issues on; a group of some ranks only
        (shard_size's, engine/hybrid.py) named with its ranks, since the groups of one name
        differ from rank to rank, and its ranks kept in `self.members`."""
        out = {}
        for name, group in records.groups_in_use().items():
            try:
                ranks = dist.get_process_group_ranks(group)
            except (RuntimeError, ValueError):  # destroyed meanwhile
                continue
            except KeyError:  # a group torch.distributed does not list: read as the job's
                ranks = None
            if ranks is not None and len(ranks) != self.world:
                name = f"{name} (ranks {', '.join(map(str, ranks))})"
                self.members[name] = list(ranks)
            recs = records.records_on(group)
            records.poll_completions(recs[-64:])
            out[name] = recs
        return out

    def _state(self, ask_store: bool = True) -> dict:
        now = time.perf_counter()
        groups = {}
        for name, recs in self._groups().items():
            waiting = _oldest_in_flight(recs)
            groups[name] = {
                "entered": recs[-1].group_seq if recs else 0,
                "waiting": _as_dict(waiting, now) if waiting is not None else None,
                "last": _as_dict(recs[-1], now) if recs else None,
                "by_seq": {r.group_seq: _as_dict(r, now) for r in recs[-64:]},
                "ranks": self.members.get(name)}
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "step": records.current_step(), "groups": groups, "stack": _main_stack(),
                "ended": self._asked(lambda: leaving.how(self.rank)) if ask_store else None}

    def _asked(self, fn, default=None):
        """`fn()`, which reads the store through leaving.py's client, bounded as every look of
        the watcher's is ([Note: a store that does not answer]); `default` if the store is
        silent."""
        try:
            return self.store.call(fn)
        except StoreSilent:
            return default

    def _tick(self) -> None:
        flag = f"{self.prefix}/flag"
        silent = 0.0  # seconds the store has not answered (store_calls.py)
        try:
            flagged = not self.settled and self.store.check([flag])
        except StoreSilent as exc:
            flagged, silent = False, exc.seconds
        if flagged:
            self._answer_and_end(reporter=False)
            return
        now = time.perf_counter()
        oldest_in = {name: _oldest_in_flight(recs) for name, recs in self._groups().items()}
        if self.on_tick is not None:  # continuing/: the others may have gone on without this rank
            self.on_tick(oldest_in)
        if self.settled:
            return
        for name, oldest in oldest_in.items():
            waited = None if oldest is None else now - oldest.started
            if waited is None:
                continue
            if silent:  # nobody can be told through the store: past the threshold, say it alone
                if waited > self.threshold:
                    self._report_alone(name, oldest, waited, silent)
                continue
            if waited > self.threshold or (
                    waited > EARLY_POLLS * self.poll and self._waits_on_an_ended_peer(name)):
                try:
                    first = self.store.add(flag, 1) == 1
                except StoreSilent as exc:
                    self._report_alone(name, oldest, waited, exc.seconds)
                self._answer_and_end(reporter=first)
                return

    def _waits_on_an_ended_peer(self, name: str) -> bool:
        """Whether a peer of group `name` has reached its end (leaving.py): a collective
        there that has waited several polls (long past its completion on the peer, had the
        peer issued it) will never complete."""
        members = self.members.get(name) or range(self.world)
        return bool(self._asked(lambda: leaving.ended([r for r in members if r != self.rank])))

    def _report_alone(self, name: str, oldest, waited: float, silent: float) -> None:
        """A collective has waited past the threshold and the job's store does not answer (see
        [Note: a store that does not answer]): the other ranks cannot be asked for their
        states, so this rank says what it knows, and ends. Its launcher then ends the others,
        and names a worker it finds frozen (launch/cleanup.py)."""
        group = "" if name == "world" else f" on group {name!r}"
        tag = f" ({oldest.tag})" if oldest.tag else ""
        state = self._state(ask_store=False)
        lines = [f"hang at step {state['step']}: rank {self.rank} has waited {waited:.1f} s in "
                 f"{oldest.kind} #{oldest.group_seq}{tag}{group}, and the job's store has not "
                 f"answered for {silent:.0f} s, so the other ranks cannot be asked: the process "
                 "that serves the store is frozen (stopped, as by SIGSTOP) or gone (under "
                 "phalanx run --on-failure restart or stop it is rank 0's worker; under torchrun "
                 "the agent)",
                 f"  rank {self.rank} ({state['host']}, pid {state['pid']}): step "
                 f"{state['step']}"]
        lines += ["      " + frame for frame in state["stack"]]
        lines.append(f"phalanx: rank {self.rank} ends with exit status {HANG_EXIT}")
        _end("phalanx: " + "\n".join(lines))

    def _answer_and_end(self, reporter: bool) -> None:
        """Write this rank's state; the reporter composes and prints the report. Then end, or
        under continue mode, go on while the ranks it names are removed.

        The store may live in one of these processes (rank 0 serves it under `phalanx run`),
        so nobody ends while another may still need it: the others acknowledge the report,
        the reporter waits for their acknowledgements and then says it is done, and each
        waits for that (every wait bounded: a store that went away ends the wait)."""
        try:
            self.store.set(f"{self.prefix}/state/{self.rank}", pickle.dumps(self._state()))
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending
            _end(f"phalanx: rank {self.rank} ends: a hang was reported")
        if reporter:
            goes_on = self._report()
        else:
            self._wait_for([f"{self.prefix}/report"], _ANSWER_WAIT + 5)
            goes_on = self._read(f"{self.prefix}/outcome") == b"goes on"
        if goes_on:  # see [Note: a member that hangs] in continuing/membership.py
            self.settled = True
            return
        if reporter:
            self._wait_for([f"{self.prefix}/ended/{r}" for r in self._answered],
                           3 * self.poll + 2)
            self._set(f"{self.prefix}/done")
            _end("")
        self._set(f"{self.prefix}/ended/{self.rank}")
        self._wait_for([f"{self.prefix}/done"], 3 * self.poll + 5)
        _end(f"phalanx: rank {self.rank} ends: a hang was reported (the message is on the "
             "reporting rank's output)")

    def _report(self) -> bool:
        """Compose and print the report; whether the job goes on (continue mode, the ranks it
        names being removed)."""
        keys = [f"{self.prefix}/state/{r}" for r in range(self.world)]
        self._wait_for(keys, _ANSWER_WAIT)
        states: dict[int, dict | None] = {}
        for r, key in enumerate(keys):
            try:
                states[r] = pickle.loads(self.store.get(key)) if self.store.check([key]) \
                    else None
            except Exception:  # noqa: BLE001 - a rank whose state cannot be read: unknown
                states[r] = None
        self._answered = [r for r, s in states.items() if s is not None and r != self.rank]
        report: HangReport = compose_report(states, self.world)
        goes_on = self.on_hang is not None and 0 < len(report.missing) < self.world
        message = "phalanx: " + report.text
        if goes_on:
            them = "it" if len(report.missing) == 1 else "them"
            tail = (f"phalanx: {ranks_text(report.missing)} "
                    f"{'is' if them == 'it' else 'are'} removed from the job (the launcher "
                    f"ends {them}); the others go on without {them}, as after a failure")
        else:
            tail = f"phalanx: every rank ends with exit status {HANG_EXIT}"
        print(f"{message}\n{tail}", file=sys.stderr, flush=True)
        if self.on_hang is not None:
            self.on_hang(report.missing if goes_on else [])
        self._set(f"{self.prefix}/outcome", b"goes on" if goes_on else b"ends")
        self._set(f"{self.prefix}/report", message.encode())
        return goes_on

    def _wait_for(self, keys: list[str], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.store.check(keys):
                    return True
            except Exception:  # noqa: BLE001 - the store went away with the process that served it
                return False
            time.sleep(0.05)
        return False

    def _read(self, key: str) -> bytes | None:
        try:
            return self.store.get(key) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store is gone: nothing to read
            return None

    def _set(self, key: str, value: bytes = b"1") -> None:
        try:
            self.store.set(key, value)
        except Exception:  # noqa: BLE001 - the store is gone: nothing to tell
            pass


def _end(message: str) -> None:
    try:
        sys.stdout.flush()
        if message:
            print(message, file=sys.stderr, flush=True)
    finally:
        os._exit(HANG_EXIT)
