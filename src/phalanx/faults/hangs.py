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
reported as a hang too, and the message says how to give it more time.
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

from .. import records

__all__ = ["HangWatch", "HANG_EXIT", "hang_threshold", "compose_report"]

HANG_EXIT = 124          # the exit status of every rank of a job ended by a hang report
_KEY = "phalanx/hang"
_ANSWER_WAIT = 10.0      # how long the reporter waits for the other ranks' states (seconds)


def hang_threshold(timeout_s: float) -> float | None:
    """Seconds a collective may wait before the hang report: PHALANX_HANG_AFTER if set ("off":
    no watcher, None), else a third of the collective timeout, so the report comes before the
    timeout's bare error."""
    value = os.environ.get("PHALANX_HANG_AFTER")
    if value and value.strip().lower() == "off":
        return None
    if value:
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"PHALANX_HANG_AFTER={value!r} is not a number of seconds (or "
                             "'off')") from None
        if not seconds > 0:
            raise ValueError(f"PHALANX_HANG_AFTER={value!r} must be a positive number of "
                             "seconds (or unset: a third of px.init's timeout)")
        return seconds
    return timeout_s / 3


def _describe(rec) -> str:
    tag = f" ({rec['tag']})" if rec["tag"] else ""
    return f"{rec['kind']} #{rec['group_seq']}{tag}"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _where(name: str) -> str:
    """Where a collective was issued, as the report says it: nothing for the job's group."""
    return "" if name == "world" else f" on group {name!r}"


def _stalled_group(answered: dict) -> str | None:
    """The group whose oldest collective in flight on some rank has waited longest, among
    those missing a member that waits in no collective at all (the rank stuck outside, whose
    absence from its group makes ranks of other groups wait in turn: shard_size's groups),
    else among all."""
    idle = {r for r, s in answered.items() if all(g["waiting"] is None
                                                  for g in s["groups"].values())}
    best, age, best_any, age_any = None, -1.0, None, -1.0
    for s in answered.values():
        for name, g in s["groups"].items():
            if g["waiting"] is None:
                continue
            if g["waiting"]["age"] > age_any:
                best_any, age_any = name, g["waiting"]["age"]
            members = g.get("ranks") or answered
            if idle.intersection(members) and g["waiting"]["age"] > age:
                best, age = name, g["waiting"]["age"]
    return best if best is not None else best_any


def compose_report(states: dict[int, dict | None], world: int) -> str:
    """One message from every rank's state (None: that rank did not answer)."""
    answered = {r: s for r, s in states.items() if s is not None}
    silent = [r for r in range(world) if r not in answered]
    step = max((s["step"] for s in answered.values()), default=0)
    name = _stalled_group(answered)
    empty = {"entered": 0, "waiting": None, "last": None, "by_seq": {}}
    members = next((s["groups"][name].get("ranks") for s in answered.values()
                    if name in s["groups"]), None) or range(world)
    on = {r: s["groups"].get(name, empty) for r, s in answered.items() if r in members}
    waiting = {r: g["waiting"] for r, g in on.items() if g["waiting"] is not None}
    lines = []
    if not waiting:
        head = "a collective waited past the threshold, but no rank waits in one any more"
    else:
        k = min(w["group_seq"] for w in waiting.values())
        ref = next(w for w in waiting.values() if w["group_seq"] == k)
        stuck = [r for r, w in waiting.items() if w["group_seq"] == k]
        waited = max(w["age"] for r, w in waiting.items() if r in stuck)
        behind = [r for r, g in on.items() if g["entered"] < k]
        other = {}
        for r, g in on.items():
            rec = g["by_seq"].get(k)
            if rec is not None and (rec["kind"], rec["tag"]) != (ref["kind"], ref["tag"]):
                other[r] = rec
        at = f"at step {step}"
        group = _where(name)
        if other:
            r, rec = next(iter(sorted(other.items())))
            head = (f"collectives out of order {at}{group}: #{k} is {ref['kind']} "
                    f"({ref['tag']}) on {_ranks(r2 for r2 in on if r2 not in other)} but "
                    f"{_describe(rec)} on {_ranks(other)}")
            steps = {s["step"] for s in answered.values()}
            if len(steps) > 1:
                head += ("; the ranks ran different numbers of steps ("
                         + ", ".join(f"rank {r2}: {s['step']}" for r2, s in sorted(answered.items()))
                         + ")")
            else:
                head += " (a rank skipped a collective, issued an extra one, or another order)"
        elif behind or any(r in members for r in silent):
            who = behind + [r for r in silent if r in members]
            head = (f"hang {at}: {_ranks(who)} {'has' if len(who) == 1 else 'have'} not entered "
                    f"{_describe(ref)}{group}; {_ranks(stuck)} "
                    f"{'has' if len(stuck) == 1 else 'have'} waited {waited:.1f} s in it")
        else:
            head = (f"hang {at}: every rank entered {_describe(ref)}{group} and none has "
                    f"completed it after {waited:.0f} s: the transport is stuck (network), or a "
                    "process is frozen in native code")
    lines.append(head)
    for r in silent:
        lines.append(f"  rank {r}: did not answer (its process has ended, or is frozen outside "
                     "Python)")
    for r, s in sorted(answered.items()):
        last = on[r]["last"] if r in on else None
        where = "no collective yet" if last is None else (
            f"last collective {_describe(last)}, "
            + ("completed" if last["done"] else f"in flight for {last['age']:.0f} s"))
        if r not in on:  # outside the stalled group: where it waits, if anywhere
            waits = [f"{_describe(g['waiting'])}{_where(n)}" for n, g in s["groups"].items()
                     if g["waiting"] is not None]
            where = "waits in " + ", ".join(waits) if waits else "waits in no collective"
        lines.append(f"  rank {r} ({s['host']}, pid {s['pid']}): step {s['step']}, {where}")
        for frame in s["stack"]:
            lines.append("      " + frame)
    lines.append("A rank that is only slow (evaluating or saving alone while the others wait) "
                 "needs a longer px.init(timeout=...) (the report comes after a third of it) or "
                 "PHALANX_HANG_AFTER=seconds.")
    return "\n".join(lines)


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
        self.store = store
        self.rank, self.world = rank, world
        self.threshold = threshold
        self.poll = poll if poll is not None else min(1.0, threshold / 4)
        # A key space per job attempt and per px.init: under a launcher whose store outlives a
        # restart, the counter goes on, so an old attempt's flag is never read as a new one's.
        attempt = (self.store.add(f"{_KEY}/joined", 1) - 1) // world
        self.prefix = f"{_KEY}/{attempt}"
        self.members: dict[str, list[int]] = {}  # a group of some ranks only -> its ranks
        self.on_tick = None  # fn(name -> oldest collective in flight or None), every tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

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

    def _state(self) -> dict:
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
                "step": records.current_step(), "groups": groups, "stack": _main_stack()}

    def _tick(self) -> None:
        flag = f"{self.prefix}/flag"
        if self.store.check([flag]):
            self._answer_and_end(reporter=False)
            return
        now = time.perf_counter()
        oldest_in = {name: _oldest_in_flight(recs) for name, recs in self._groups().items()}
        if self.on_tick is not None:  # elastic/: the others may have gone on without this rank
            self.on_tick(oldest_in)
        for oldest in oldest_in.values():
            if oldest is not None and now - oldest.started > self.threshold:
                first = self.store.add(flag, 1) == 1
                self._answer_and_end(reporter=first)
                return

    def _answer_and_end(self, reporter: bool) -> None:
        """Write this rank's state; the reporter composes and prints the report. Then end.

        The store may live in one of these processes (rank 0 serves it under `phalanx run`),
        so nobody ends while another may still need it: the others acknowledge the report,
        the reporter waits for their acknowledgements and then says it is done, and each
        waits for that (every wait bounded: a store that went away ends the wait)."""
        try:
            self.store.set(f"{self.prefix}/state/{self.rank}", pickle.dumps(self._state()))
        except Exception:
            _end(f"phalanx: rank {self.rank} ends: a hang was reported")
        if reporter:
            self._report()
        self._wait_for([f"{self.prefix}/report"], _ANSWER_WAIT + 5)
        self._set(f"{self.prefix}/ended/{self.rank}")
        self._wait_for([f"{self.prefix}/done"], 3 * self.poll + 5)
        _end(f"phalanx: rank {self.rank} ends: a hang was reported (the message is on the "
             "reporting rank's output)")

    def _report(self) -> None:
        keys = [f"{self.prefix}/state/{r}" for r in range(self.world)]
        self._wait_for(keys, _ANSWER_WAIT)
        states: dict[int, dict | None] = {}
        for r, key in enumerate(keys):
            try:
                states[r] = pickle.loads(self.store.get(key)) if self.store.check([key]) \
                    else None
            except Exception:
                states[r] = None
        message = "phalanx: " + compose_report(states, self.world)
        print(message + f"\nphalanx: every rank ends with exit status {HANG_EXIT}",
              file=sys.stderr, flush=True)
        self._set(f"{self.prefix}/report", message.encode())
        self._wait_for([f"{self.prefix}/ended/{r}" for r, s in states.items()
                        if s is not None and r != self.rank], 3 * self.poll + 2)
        self._set(f"{self.prefix}/done")
        _end("")

    def _wait_for(self, keys: list[str], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.store.check(keys):
                    return True
            except Exception:  # the store went away with the process that served it
                return False
            time.sleep(0.05)
        return False

    def _set(self, key: str, value: bytes = b"1") -> None:
        try:
            self.store.set(key, value)
        except Exception:
            pass


def _end(message: str) -> None:
    try:
        sys.stdout.flush()
        if message:
            print(message, file=sys.stderr, flush=True)
    finally:
        os._exit(HANG_EXIT)
