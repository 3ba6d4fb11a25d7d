"""The hang report's message, from every rank's state (faults/hangs.py gathers them).

Each rank's watcher writes its state: the records of every group it issues on (for each, how
far it has entered, the oldest collective still in flight and the newest ones by number), its
optimizer step, how it ended if it has reached its end (leaving.py), and its main thread's
stack. `compose_report` finds the group where a collective has waited longest and says what
differs there: a rank that has not entered the collective the others wait in (and, if it has
reached its end, that it left early), collectives in another order, or every rank inside one
that does not complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["HangReport", "compose_report", "ranks_text"]


@dataclass
class HangReport:
    text: str
    # the ranks that have not entered the collective the others wait in, or did not answer:
    # those the job waits for (empty when the report blames no rank)
    missing: list[int] = field(default_factory=list)


def _describe(rec) -> str:
    tag = f" ({rec['tag']})" if rec["tag"] else ""
    return f"{rec['kind']} #{rec['group_seq']}{tag}"


def ranks_text(ranks) -> str:
    """'rank 1', 'ranks 0, 2'."""
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


def compose_report(states: dict[int, dict | None], world: int) -> HangReport:
    """One message from every rank's state (None: that rank did not answer), and the ranks it
    names as those the others wait for."""
    answered = {r: s for r, s in states.items() if s is not None}
    silent = [r for r in range(world) if r not in answered]
    step = max((s["step"] for s in answered.values()), default=0)
    name = _stalled_group(answered)
    empty = {"entered": 0, "waiting": None, "last": None, "by_seq": {}}
    members = next((s["groups"][name].get("ranks") for s in answered.values()
                    if name in s["groups"]), None) or range(world)
    on = {r: s["groups"].get(name, empty) for r, s in answered.items() if r in members}
    waiting = {r: g["waiting"] for r, g in on.items() if g["waiting"] is not None}
    lines, missing = [], []
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
                    f"({ref['tag']}) on {ranks_text(r2 for r2 in on if r2 not in other)} but "
                    f"{_describe(rec)} on {ranks_text(other)}")
            steps = {s["step"] for s in answered.values()}
            if len(steps) > 1:
                head += ("; the ranks ran different numbers of steps ("
                         + ", ".join(f"rank {r2}: {s['step']}"
                                     for r2, s in sorted(answered.items())) + ")")
            else:
                head += " (a rank skipped a collective, issued an extra one, or another order)"
        elif behind or any(r in members for r in silent):
            missing = behind + [r for r in silent if r in members]
            head = (f"hang {at}: {ranks_text(missing)} "
                    f"{'has' if len(missing) == 1 else 'have'} not entered "
                    f"{_describe(ref)}{group}; {ranks_text(stuck)} "
                    f"{'has' if len(stuck) == 1 else 'have'} waited {waited:.1f} s in it")
            for r in behind:  # a rank at its end never comes (leaving.py)
                if answered[r].get("ended"):
                    head += (f"; rank {r} has reached its end ({answered[r]['ended']} at step "
                             f"{answered[r]['step']}): it left early")
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
    return HangReport("\n".join(lines), sorted(missing))
