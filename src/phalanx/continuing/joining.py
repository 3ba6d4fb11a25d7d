"""A replacement joins: it waits, the others admit it at their next `px.save`, and it loads
what that save wrote, which is their live state.

[Note: joining at a save]
A replacement runs the script from the top, as after a restart, so the script's own resume
lines decide where it stands:

    ckpt = px.latest_checkpoint("checkpoints")
    start = px.load(ckpt, model=model, optimizer=optimizer, sampler=loader.sampler)["step"] + 1

Its `px.latest_checkpoint` asks to be admitted (`join/<rank>` in the job's store) and waits.
The others, at their next `px.save`, see the request once the checkpoint is complete and
admit it: they name it in the next generation's members, form that group with it, and every
member loads the checkpoint just written (the others reload their own state, which leaves it
as it was; under a sharded strategy that is also how the shards move to the new layout).
So the replacement's `px.load` returns exactly the values the others passed to that save
(`step=...`), its sampler stands where theirs stand, and its next iteration is theirs: the
script's counters agree on every rank without phalanx knowing what they count. A save is
the one point where the others' loop state is handed over whole; a script that saves every
K steps admits a replacement within K steps, and one that never calls `px.save` never
admits one (the replacement leaves when the job ends, saying so).

Before its admission a replacement's `px.prepare` builds the engine for the job's world but
talks to nobody (its Comms wait without a group: runtime.job_comm), so nothing it does
before `px.load` needs the others.
"""

from __future__ import annotations

import sys
import time

from ..comm import continuation, records
from ..comm.gate import gate
from ..model.relayout import needs_relayout, relayout
from ..world.runtime import default_comm
from . import store as keys
from .membership import debug

__all__ = ["wait_for_admission", "joiners_asking", "admit", "join", "sync_engines",
           "rebuild_engines", "live_models", "leave_unadmitted", "cannot_join"]

def live_models() -> list:
    """The prepared models of this process (`watch_model`), in prepare order."""
    return continuation.now().models()


def sync_engines(comm) -> None:
    """After a new group is formed: every member's engines take the launch order and step
    count of the first member that has them settled (see [Note: launch order follows
    readiness] in engine/reducer.py); where no member has, the next backward decides it."""
    for prepared in live_models():
        engine = prepared._engine
        mine = engine.elastic_state()
        every = comm.all_gather_object(mine, tag="elastic:engine state")
        source = next((s for s in every if s["settled"]), None)
        debug(f"sync: mine {mine['settled']} every {[s['settled'] for s in every]} cut {gate.cut}")
        engine.set_elastic_state(source)


def rebuild_engines() -> list:
    """After a new group is formed (every member calls it): sharded engines laid out for
    another group are built again for this one (model/relayout.py), then the engines agree
    (`sync_engines`). Returns the prepared models rebuilt: their state is to be loaded."""
    rebuilt = [m for m in live_models() if needs_relayout(m)]
    for prepared in rebuilt:
        relayout(prepared)
    sync_engines(default_comm())
    return rebuilt


# -- the replacement ----------------------------------------------------------------------------
def wait_for_admission(m) -> dict:
    """Ask to join and wait until admitted (the admission: generation, members, checkpoint,
    step counts), or until the job ends without admitting (`leave_unadmitted`)."""
    found = keys.read(m.store, f"admitted/{m.me}.{m.life}")
    if found is not None:
        return found
    keys.write(m.store, f"join/{m.me}", {"life": m.life, "time": time.time()})

    def admitted_or_over():
        if keys.has(m.store, f"admitted/{m.me}.{m.life}"):
            return True
        gen = keys.read(m.store, "gen", 0)
        members = keys.read(m.store, f"gen{gen}/members", [])
        why = []
        for rank, life in members:  # the first member still in ends the look
            gone = m.gone(rank, life)
            if gone is None:
                return False
            why.append(gone)
        if why:
            leave_unadmitted(m, completed=any(w.get("done") for w in why))
        return False

    deadline = time.monotonic() + max(m.timeout.total_seconds(), 24 * 3600)
    while not admitted_or_over():
        if time.monotonic() > deadline:
            leave_unadmitted(m)
        time.sleep(0.05)
    return keys.read(m.store, f"admitted/{m.me}.{m.life}")


def leave_unadmitted(m, completed: bool = True) -> None:
    """No member is left to admit this replacement: end this worker, successfully if a member
    finished its training (`completed`); else every member failed, and so does the job (a
    replacement that ended well there would have the launcher report a job completed when
    no rank finished)."""
    if completed:
        print(f"phalanx: the replacement of rank {m.me} was not admitted: the job ended before "
              "the others' next px.save", file=sys.stderr, flush=True)
        raise SystemExit(0)
    raise SystemExit(f"phalanx: the replacement of rank {m.me} was not admitted: every member "
                     "of the job failed before admitting it (see their errors above)")


def cannot_join(m) -> None:
    """A replacement begins training without having loaded the others' state: it cannot take
    part (its weights and place in the data are its own), so it ends, successfully."""
    print(f"phalanx: the replacement of rank {m.me} cannot join: the script trains before any "
          "px.latest_checkpoint / px.load, which is where a replacement takes the others' "
          "state (see docs/guides/failures.md); the job goes on without it",
          file=sys.stderr, flush=True)
    raise SystemExit(0)


def join(m, steps, load) -> dict:
    """The replacement's `px.load`: be admitted, form the group, take the engines' state, and
    `load(path)` the checkpoint the others just saved; returns what `load` returns."""
    admission = wait_for_admission(m)
    m.joining = False
    steps.calls, steps.last_voted = admission["calls"], admission["last_voted"]
    m.admitting = True  # an error from here on is not one of a training step (steps.py)
    try:
        if m.form(admission["gen"], admission["members"]):
            rebuild_engines()
        return load(admission["path"])  # lost meanwhile: read alone, then the recovery
    finally:
        m.admitting = False


# -- the others ---------------------------------------------------------------------------------
def requests(m) -> list[tuple[int, int]]:
    """(rank, life) of every replacement asking to join, as this rank reads the store."""
    out = []
    members = {rank for rank, _ in m.members}
    for rank in range(m.launch_world):
        if rank in members:
            continue
        asked = keys.read(m.store, f"join/{rank}")
        if asked is not None and m.gone(rank, asked["life"]) is None:
            out.append((rank, asked["life"]))
    return out


def joiners_asking(steps, comm) -> list[tuple[int, int]]:
    """At the start of a `px.save` (every member calls it): the replacements asking to join,
    as rank 0 reads them; none while a recovery is not over."""
    m = steps.m
    if gate.cut or steps.decision is not None or steps.resume_due:
        return []
    return comm.all_gather_object(requests(m) if comm.rank == 0 else None,
                                  tag="elastic:join requests")[0] or []


def admit(m, steps, comm, asking, path: str, reload) -> None:
    """At the end of a `px.save` that wrote `path` (every member calls it): admit `asking`,
    then `reload(path)` on every member (see [Note: joining at a save]).

    Whether the admission happens is rank 0's word in the store (`admit<g>`: the next
    generation's members, or None when the save was cut short), read by every member, so a
    member whose last collective failed still forms the same group as the others; a member
    lost meanwhile makes that group fail to form, and the next step recovers from it."""
    gen = m.gen + 1
    key = f"admit{m.gen}"
    if comm.rank == 0:
        members = None if gate.cut else sorted(m.members + asking)
        for rank, life in asking if members else ():
            keys.write(m.store, f"admitted/{rank}.{life}",
                       {"gen": gen, "members": members, "path": path, "calls": steps.calls,
                        "last_voted": steps.last_voted})
            m.store.delete_key(f"join/{rank}")
        keys.write(m.store, key, members)
    first = m.members[0]
    word: list = []

    def said() -> bool:
        if keys.has(m.store, key):
            word.append(keys.read(m.store, key))
            return True
        if m.gone(*first) is not None:
            word.append(None)
            return True
        return False

    m.wait_for("rank 0's word on the admission", said)
    members = word[0]
    if members is None:
        gate.cut = True  # rank 0 was lost, or saw the save cut short: the next step recovers
        return
    began, speaker = time.time(), comm.rank == 0
    m.drop_group()
    if m.form(gen, members):
        rebuild_engines()
    reload(path)
    if steps.events is not None and not gate.cut:
        steps.events.joined([rank for rank, _ in asking], records.current_step(),
                            time.time() - began, [life for _, life in asking], speaker)
