"""The step boundary under `--on-failure continue`: the vote, the recovery, the redo.

[Note: the commit vote]
A step commits when every member has its gradients averaged. Each rank knows that of itself
(its collectives of the step completed) but not of the others: a collective can complete on
one rank and fail on another when a peer dies inside it (gloo fails a rank whose send to the
dead peer fails after it has received all it needs). So every `optimizer.step()` first takes
part in a vote: one all-reduce of one element. A rank enters it only with its own averaging
complete, so a rank that sees the vote complete knows that every member had its gradients
(whatever the vote then does on the others), and commits the step.

A rank whose wire was cut (gate.py) reports at its next `optimizer.step()` what it knows: how
many steps it has called (`calls`), the last one whose vote it saw complete (`last_voted`) and
whether it entered the vote of its current one. From every survivor's report each computes the
same decision (`decide`):

- K = the largest `last_voted`: step K's vote completed somewhere, so every survivor entered
  it with its gradients averaged; a survivor whose vote of K failed commits K now;
- R = the largest `calls`: the survivors stand at different steps (one saw the failure in
  step K's vote, another only in step K+1), so those behind drop every step up to R
  unused, with no communication, until all stand at step R;
- every step after K is thrown away, and after step R each rank resumes at its next iteration
  (the next batch a `px.data_loader` hands out, or the next forward with gradients): its
  samplers go back to where they stood at step K, so the next global batch is the first one
  not committed, now split over the survivors (the sampler's one global order makes this the
  same samples), and training goes on on the new group.

When the member that left had raised an exception in a step after K (it said so in the store
before it ended: an error in one rank's forward or backward, not a death), the steps after K
are skipped instead of redone: their batches are not served again, as if the job had skipped
them. One that raised inside the optimizer.step() of K itself, after K's vote, had its
gradients averaged with everyone's in K: the steps after K are healthy, and are redone.

A loss seen in an evaluation between two steps is recovered from where it is seen, in the
evaluation's `px.gather_for_metrics`, and the evaluation's batch in flight is redone ([Note:
an evaluation redone] in gathers.py); the reports and the decision carry its gathers too.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from dataclasses import dataclass, field

import torch

from ..checkpoint.api import fallbacks, load_checkpoint
from ..checkpoint.reader import CheckpointError, read_manifest
from ..comm.gate import gate
from ..data.ledger import step_called
from ..data.replay import Replayable
from ..data.sampler import DistributedSampler
from ..model.prepare import prepared_or_none
from . import joining, store as keys
from .gathers import Gathers, decide_gathers
from .membership import Membership, MembershipError, debug

__all__ = ["StepBoundary", "Decision", "decide", "POKE_AFTER", "LEFT_BEHIND"]

POKE_AFTER = 2.0   # seconds the others wait for a member's report before asking it
LEFT_BEHIND = 125  # the exit status of a member that could not report (watch_tick)


@dataclass
class Decision:
    """What the survivors agreed after generation `gen` lost members (see the Note)."""
    gen: int
    committed: int                 # K
    resume_after: int              # R
    survivors: list                # (rank, life) of every member of the next generation
    gone: dict                     # launch rank -> why (store.py's left/raised/done)
    skip: bool                     # a member raised: the lost steps' batches are skipped
    reports: dict = field(default_factory=dict)   # launch rank -> (life, report)
    checkpoint: str | None = None  # what sharded engines loaded (see _reload)
    lost_at: float = 0.0           # time.time() when this rank saw the loss
    formed_at: float = 0.0         # ... when the next group was formed
    step_times: list = field(default_factory=list)
    gathered: int = 0              # the last px.gather_for_metrics every survivor holds whole
    evaluation: int | None = None  # the evaluation batch redone (gathers.py), if one is


def decide(gen: int, reports: dict, gone: dict) -> Decision:
    """The decision every survivor computes from the same reports (launch rank -> (life,
    report)) and departures (launch rank -> why). See [Note: the commit vote]."""
    if not gone:
        raise MembershipError("no member left the job")
    committed = max(rep["last_voted"] for _, rep in reports.values())
    for rank, (_, rep) in reports.items():
        if rep["last_voted"] != committed and not (rep["calls"] == committed and rep["phase1"]):
            raise MembershipError(
                f"phalanx: the members disagree on the last step all of them averaged (rank "
                f"{rank} committed step {rep['last_voted']}, another {committed}); this is a "
                "bug: please report it with the console output")
    gathered, evaluation = decide_gathers(reports)
    return Decision(gen, committed, max(rep["calls"] for _, rep in reports.values()),
                    sorted((rank, life) for rank, (life, _) in reports.items()), dict(gone),
                    any(why["raised"].get("call", committed + 1) > committed
                        for why in gone.values() if "raised" in why), dict(reports),
                    gathered=gathered, evaluation=evaluation)


class _Rewind:
    """A sampler as a sharded engine's reload loads it: its replay part sends it back to the
    checkpoint at the next resume, keeping what the lost steps consumed (data/replay.py's
    [Note: a step redone])."""

    def __init__(self, sampler: DistributedSampler):
        self.replay = sampler.replay

    def load_state_dict(self, state: dict) -> None:
        self.replay.rewind_to(state)


def _held(stateful: dict) -> list:
    """The replay parts of the samplers among a px.save's stateful objects."""
    return [v.replay for v in stateful.values() if isinstance(v, DistributedSampler)]


class StepBoundary:
    """This process's steps under continue mode (one per process: every prepared optimizer's
    `step()` passes through `before_step`)."""

    def __init__(self, membership: Membership):
        self.m = membership
        self.calls = 0          # optimizer.step() calls made by this process
        self.last_voted = 0     # the last call whose vote this rank saw complete
        self.voting = 0         # the call whose vote this rank entered (its averaging done)
        self.decision: Decision | None = None   # from the last recovery, until its resume
        self.resume_due = False
        self.lost_at: float | None = None
        self.cause: BaseException | None = None
        self.samplers: "weakref.WeakSet[Replayable]" = weakref.WeakSet()  # their replay parts
        self.on_lost: list = []     # called first when the wire is cut (the hang watcher stops)
        self.on_resume: list = []   # called with the decision when training goes on
        self._vote = None
        self.events = None          # events.py's Events, once made
        self.last_save = None       # (path, model, optimizer, stateful) of the last px.save
        self.unsaved: dict = {}     # path -> [(sampler ref, its ledger)] of samplers not in it
        self.stepping = False       # a forward with gradients since the last optimizer.step()
        self.gathers = Gathers(self)  # px.gather_for_metrics: [Note: an evaluation redone]

    # -- the wire is cut ------------------------------------------------------------------------
    def lost(self, exc: BaseException) -> None:
        """gate.on_loss: see [Note: generations] in membership.py."""
        # Kept without its traceback: the frames would keep the failed collective's work, and
        # with it the old group's connections, open, and a peer waiting on this rank would
        # then wait for the timeout instead of failing at once (seen: 200 s, then the hang
        # report ended that peer).
        self.lost_at, self.cause = time.time(), exc.with_traceback(None)
        debug(f"lost at call {self.calls}: {exc}"[:200])
        for fn in list(self.on_lost):
            fn()
        self.m.drop_group()

    # -- the boundary ---------------------------------------------------------------------------
    def before_step(self, comm) -> bool:
        """Called as `optimizer.step()` begins; whether the step may run (False: the caller
        drops its gradients so that the step changes nothing)."""
        self.calls += 1
        call = self.calls
        self.stepping = False
        step_called(self.samplers)  # See [Note: the ledger] in data/ledger.py
        if not gate.cut and self.decision is None:
            self.voting = call
            if self._vote is None or self._vote.device != comm.device:
                self._vote = torch.ones(1, device=comm.device)
            self._vote.fill_(1.0)
            comm.all_reduce(self._vote, op="sum", tag="elastic:vote")
            if not gate.cut:
                self._committed(call)
                return True
        if self.decision is None:
            self.decision = self.recover(call)
        d = self.decision
        debug(f"step call {call} K {d.committed} R {d.resume_after} voting {self.voting} "
              f"last_voted {self.last_voted}")
        run = call == d.committed and self.voting == call and self.last_voted < call
        if run:
            self._committed(call)
        if call >= d.resume_after:
            self.resume_due = True
        return run

    def _committed(self, call: int) -> None:
        self.last_voted = call
        for sampler in list(self.samplers):
            sampler.commit_step()

    def recover(self, call: int) -> Decision:
        """Report, wait for every member's report or departure, decide, form the next group
        and bring every member's engines to the same launch order (another loss meanwhile:
        the same again, from the group just formed)."""
        m = self.m
        while True:
            decision = self._decide(call)
            if not m.form(m.gen + 1, decision.survivors):
                continue  # lost again before the group was made: from that generation on
            gate.cut = False  # open for the members' own agreement, cut again after it
            # sharded engines laid out again; launch order agreed
            rebuilt = joining.rebuild_engines()
            if rebuilt and not gate.cut:
                self._reload(rebuilt, decision)
            if not gate.cut:
                gate.cut = True  # the rest of the lost step stays on this rank alone
                decision.formed_at = time.time()
                return decision

    def recover_between_steps(self) -> Decision:
        """A loss seen in an evaluation's gather while no step is in flight: the recovery
        runs there, not at the next optimizer.step(), and the evaluation goes on at its
        loader's next batch ([Note: an evaluation redone] in gathers.py)."""
        self.decision = self.recover(self.calls)
        if self.calls >= self.decision.resume_after:
            self.resume_due = True
        return self.decision

    def _decide(self, call: int) -> Decision:
        """Report to the store and wait for every member's report or departure; the decision
        (see [Note: the commit vote])."""
        m = self.m
        gen = m.gen
        keys.write(m.store, f"gen{gen}/report/{m.me}",
                   {"calls": call, "last_voted": self.last_voted, "phase1": self.voting == call,
                    "cause": f"{type(self.cause).__name__}: {self.cause}"[:500],
                    "saved": self.last_save[0] if self.last_save is not None else None,
                    **self.gathers.report()})
        reports: dict = {}
        gone: dict = {}

        def everyone_known() -> bool:
            for rank, life in m.members:
                if rank in reports or rank in gone:
                    continue
                rep = keys.read(m.store, f"gen{gen}/report/{rank}")
                if rep is not None:
                    reports[rank] = (life, rep)
                    continue
                why = m.gone(rank, life)
                if why is not None:
                    gone[rank] = why
            return len(reports) + len(gone) == len(m.members)

        began = time.monotonic()

        def everyone_known_or_poked() -> bool:
            known = everyone_known()
            if not known and time.monotonic() - began > POKE_AFTER:
                for rank, life in m.members:
                    if rank not in reports and rank not in gone:
                        keys.write(m.store, f"gen{gen}/poke/{rank}.{life}", True)
            return known

        m.wait_for("every member's report after a failure", everyone_known_or_poked)
        try:
            decision = decide(gen, reports, gone)
        except MembershipError as exc:
            if str(exc) == "no member left the job":  # not a departure: the original error
                raise self.cause from None
            raise
        decision.lost_at = self.lost_at or time.time()
        return decision

    def saved(self, path: str, model, optimizer, stateful: dict) -> None:
        """A `px.save` completed: where a sharded engine takes the state back from after a
        loss (see [Note: a sharded engine after a loss])."""
        self.last_save = (path, model, optimizer, stateful)
        held = _held(stateful)
        self.unsaved[path] = [(weakref.ref(s), s.ledger.rows()) for s in list(self.samplers)
                              if s.ledger is not None and all(v is not s for v in held)]
        for old in list(self.unsaved)[:-4]:
            del self.unsaved[old]

    def check_ledgers(self, samplers, when: str) -> None:
        """Every sampler's counts balance ([Note: the ledger] in data/ledger.py), unless a
        recovery is under way (its replay is counted at the next check)."""
        if gate.cut or self.decision is not None or self.resume_due:
            return
        wrong = [line for s in samplers if s.ledger is not None
                 for line in s.ledger.mismatches()]
        if wrong:
            raise MembershipError(
                f"phalanx: {when}, the model does not hold what the loop was served after a "
                f"recovery from a lost rank: {'; '.join(wrong)}. A lost step's batches are "
                "served again only by px.data_loader, and under zero1/zero2/zero3 only from "
                "a px.save that was given sampler=loader.sampler; otherwise this is a bug in "
                "phalanx (please report it with the console output). The job ends here rather "
                "than complete with weights an uninterrupted run would not have")

    def _reload(self, rebuilt: list, decision: Decision) -> None:
        """[Note: a sharded engine after a loss]
        Under zero1/2/3 a lost rank takes its shard of the optimizer state (and under zero3 of
        the parameters) with it; nobody else holds it. So every survivor's engine, built again
        for the new group (model/relayout.py), loads the newest checkpoint any survivor saw
        complete, and the samplers go back to where it stands: the steps after it are redone,
        and when the script saves after every step that is only the step in flight, exactly as
        under ddp. A job that has saved nothing yet cannot go on."""
        newest = None
        for path in sorted({rep["saved"] for _, rep in decision.reports.values()
                            if rep.get("saved")}):
            try:
                at = read_manifest(path)["saved_at"]
            except (CheckpointError, OSError, KeyError):
                continue
            newest = max(newest or (at, path), (at, path))
        save = self.last_save
        if newest is None or save is None or any(prepared_or_none(save[1]) is not m
                                                 for m in rebuilt):
            raise MembershipError(
                "phalanx: a rank was lost under a sharded strategy (zero1/zero2/zero3), and its "
                "shard of the model's state is nowhere but in a checkpoint: the job has none "
                "of this model yet. Call px.save(..., model=model, optimizer=optimizer, "
                "sampler=loader.sampler) every few steps (after every step, only the step in "
                "flight is redone)")
        stateful = {name: _Rewind(v) if isinstance(v, DistributedSampler) else v
                    for name, v in save[3].items()}
        skipped = []
        for path in fallbacks(newest[1]):  # newest first, this job's only (checkpoint/api.py)
            try:  # a damaged one raises alike on every rank (its files are checked collectively)
                load_checkpoint(path, save[1], save[2], True, stateful, restore_rng=False)
            except CheckpointError as exc:
                skipped.append(f"{path}: {exc}")
                continue
            decision.checkpoint = path
            break
        else:
            raise MembershipError("phalanx: a rank was lost under a sharded strategy and no "
                                  f"checkpoint of this job verifies: {'; '.join(skipped)}")
        if skipped and self.m.rank == 0:
            print(f"phalanx: skipped damaged checkpoint(s), reloading {decision.checkpoint}: "
                  + "; ".join(skipped), file=sys.stderr, flush=True)
        self.ledgers_back_to(decision.checkpoint, save[3])

    def ledgers_back_to(self, path: str, stateful: dict) -> None:
        """The model went back to checkpoint `path`: a sampler it does not hold (not among
        `stateful`) cannot go back with it, but its ledger does (to its counts at that save,
        or to nothing where unknown) and finds the batches lost ([Note: the ledger])."""
        kept = {id(ref()): rows for ref, rows in self.unsaved.get(path, [])}
        held = _held(stateful)
        for sampler in list(self.samplers):
            if sampler.ledger is not None and all(v is not sampler for v in held):
                sampler.ledger.rewound(kept.get(id(sampler)))

    def watch_tick(self, oldest_in_flight: dict) -> None:
        """[Note: a member left behind]
        A member can stay blocked in a collective of a generation the others have already left:
        gloo fails a collective when a peer's connection closes, and a peer that gave the group
        up does not always close its end at once (something it cannot see still holds the
        group). The others then wait for its report. After `POKE_AFTER` seconds they ask it,
        through the store, to report; its hang watcher (this function, every tick) sees the
        request, and if the main thread is in a collective that has waited longer than that,
        the main thread's wait gives up at its next 100 ms slice (`gate.poked`: [Note: waiting
        on a group the others may have left] in completion.py), the step is lost on this rank
        too, and it reports as any survivor. A wait that cannot give up (a collective called
        through torch.distributed directly) leaves the rank stuck: then it says so and leaves,
        so that the others go on without it (its replacement joins as any). A member only slow
        to reach its step is not in a collective, and reports when it gets there."""
        m = self.m
        if gate.cut or not keys.has(m.store, f"gen{m.gen}/poke/{m.me}.{m.life}"):
            return
        now = time.perf_counter()
        stuck = [(name, rec) for name, rec in oldest_in_flight.items()
                 if rec is not None and now - rec.started > POKE_AFTER]
        if not stuck:
            return
        name, rec = stuck[0]
        if not gate.poked:  # the main thread's wait gives up at its next slice (completion.py)
            gate.poked = True
            return
        if now - rec.started < 4 * POKE_AFTER:
            return
        print(f"phalanx: rank {m.rank} was still waiting in {rec.kind} #{rec.group_seq} "
              f"({rec.tag}) on group {name!r} when the others went on after losing a rank; it "
              "leaves so that they do not wait for it (its replacement joins as any)",
              file=sys.stderr, flush=True)
        os._exit(LEFT_BEHIND)

    # -- what the floors below call (through session.py's Session) ------------------------------
    def iteration_starts(self, batch: bool) -> bool:
        if self.m.joining:  # training begins before any px.load took the others' state
            joining.cannot_join(self.m)
        resumed = self.resume_if_due()
        if not batch:  # a forward with gradients: a step is in flight (gathers.py)
            self.stepping = True
        return resumed

    def finish(self) -> None:
        """`px.shutdown` after a loss seen past this rank's last step: the recovery, here
        (comm/continuation.py's `finish`)."""
        if self.decision is None:
            self.decision = self.recover(self.calls)
        self.resume_due = True
        self.resume_if_due()

    def joiners_asking(self, comm) -> list:
        return joining.joiners_asking(self, comm)

    def admit(self, comm, asking, path: str, model, optimizer, stateful: dict) -> None:
        """At the end of a `px.save` of `path`: admit `asking`, every member loading `path`
        (the others keep their own RNG) as the replacements do (joining.py)."""
        joining.admit(self.m, self, comm, asking, path, lambda at: load_checkpoint(
            at, model, optimizer, True, stateful, restore_rng=False))

    def join(self, load) -> dict:
        return joining.join(self.m, self, load)

    def admission_path(self) -> str:
        return joining.wait_for_admission(self.m)["path"]

    # -- going on -----------------------------------------------------------------------------
    def resume_if_due(self) -> bool:
        """At the start of an iteration: if the step R of the last recovery has passed, open
        the wire again and send the samplers back (or on: skip) to the last committed step."""
        if not self.resume_due:
            return False
        d = self.decision
        self.resume_due, self.decision = False, None
        gate.cut = gate.poked = False
        for sampler in list(self.samplers):
            sampler.resume_after_loss(skip=d.skip)
        for fn in list(self.on_resume):
            fn(d)
        return True
