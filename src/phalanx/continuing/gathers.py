"""An evaluation under `--on-failure continue`: each `px.gather_for_metrics` voted on, and the
batch in flight when a rank is lost gathered again by the others.

[Note: an evaluation redone]
An evaluation is forwards under `torch.no_grad()` over a `px.data_loader`, each batch's outputs
gathered with `px.gather_for_metrics`, between two optimizer steps. A rank lost in it left
each survivor with what a collective returns on a broken group (its own values: cut.py) for
every batch left, a loss that differed from rank to rank, and its sampler was then sent back
with the training samplers at the next step's recovery, so that the next pass served the
finished one again (each sample twice). So each gather is handled as a step is ([Note: the
commit vote] in steps.py):

- A gather that completes on this rank is followed by a vote (one all-reduce of one element).
  A rank enters it only with its gather complete, so a rank that sees it complete knows that
  every member holds the whole result, and returns it (`gathered_whole`).
- A gather or vote lost, with no optimizer step in flight (no forward with gradients and no
  training batch taken since the last `optimizer.step()`): the survivors recover right there
  (steps.py's `recover`: the reports, the decision, the next group; a sharded engine reloads
  its newest checkpoint, the one saved after the last step when the script saves every step).
  The decision names the last gather whose vote completed on any survivor (gathers are
  counted per generation: every member's count starts at 0 when a group forms); a survivor
  that entered that vote returns its whole result, and every other gather lost returns an
  empty one, the value's structure with no samples (zero rows; an empty list; a 0-d value's
  stack of none), which adds nothing to what the loop accumulates.
- At the loader's next batch the wire opens (steps.py's `resume_if_due`) and the evaluation's
  sampler serves the batch in flight again, split over the ranks there are now (its global
  batch is kept for its life: sampler.py), then the rest of the pass (data/replay.py's
  `_evaluation_resumes`). A gather of that batch that had already returned whole (the batch's
  first of two, say) returns an empty result, on every rank alike and with no collective: the
  votes made the ranks agree on which those are.

So what the loop gathered holds each sample once, and so does every later pass: a sampler no
step ever took a batch of (the ledger's `trained`) is never sent back across the end of a pass.
One line from the new rank 0 says what happened (events.py).

An evaluation that cannot be redone returns empty results from the loss on, and its loader
says so at the end of its pass, on every rank that lost a gather: an optimizer step in flight
(the recovery then waits for its `optimizer.step()`, as in training: a forward with gradients
or a training batch taken before the evaluation), a sharded engine that reloaded a checkpoint
older than the last step (the batches after the loss would see other weights than those
before it), or a loader over an IterableDataset (a stream cannot serve a batch again). So
does, from its first gather, an evaluation made while the model lacks what the loop took (the
training ledgers differ: a step lost with a rank just before it, redone only at the loop's
next training batch): it would not see the uninterrupted run's weights.
"""

from __future__ import annotations

import os
import sys

import torch

from ..comm.gate import gate
from .membership import MembershipError, debug

__all__ = ["Gathers", "decide_gathers"]

# Why an evaluation is incomplete (the line at the end of its pass)
_IN_FLIGHT = ("a rank was lost while an optimizer step was in flight (a forward with gradients, "
              "or a training batch taken, since the last optimizer.step()), so the batches from "
              "the loss on were not redone: evaluate after optimizer.step() and before the next "
              "batch, under torch.no_grad()")
_AHEAD = ("a rank was lost while another had gone on to the next optimizer step, so the batches "
          "from the loss on were not redone")
_WENT_BACK = ("a rank was lost and the survivors reloaded {}, saved before the last optimizer "
              "step, so the batches from the loss on were not redone (they would see other "
              "weights than those before it): a px.save after every step has them redone")
_BEHIND = ("it began before the model had trained again what a lost rank took with it ({}; "
           "the lost step is redone at the loop's next batch), so none of its batches were "
           "gathered: they would not see the uninterrupted run's weights")
_NOT_SERVED = "a rank was lost and the batch in flight was not served again"


def decide_gathers(reports: dict) -> tuple[int, int | None]:
    """From every survivor's report (launch rank -> (life, report)): the last gather whose vote
    completed anywhere, and the evaluation batch in flight where a survivor recovered in one
    (None: none did). See [Note: an evaluation redone]."""
    last = max(rep.get("gathered", 0) for _, rep in reports.values())
    for rank, (_, rep) in reports.items():
        if rep.get("gathered", 0) != last and not (rep.get("gathers") == last
                                                    and rep.get("gather_phase1")):
            raise MembershipError(
                f"phalanx: the members disagree on the last px.gather_for_metrics all of them "
                f"completed (rank {rank} completed gather {rep.get('gathered', 0)}, another "
                f"{last}); this is a bug: please report it with the console output")
    batches = [rep["evaluation"] for _, rep in reports.values()
               if rep.get("evaluation") is not None]
    return last, min(batches) if batches else None


class Gathers:
    """This process's `px.gather_for_metrics` calls under continue mode; kept by the
    StepBoundary (steps.py) whose recovery they call."""

    def __init__(self, steps):
        self.steps = steps
        self.calls = 0        # gathers begun on this generation's group
        self.last_voted = 0   # the last of them whose vote this rank saw complete
        self.voting = 0       # the one whose vote this rank entered (its gather complete)
        self.batch = None     # the evaluation batch in flight while recovering in a gather
        self._vote = None
        self._said_stream = False
        if steps.m is not None:  # (a StepBoundary made without members, in a test)
            steps.m.on_regroup.append(self.regrouped)

    def regrouped(self, _group) -> None:
        """A group formed (a recovery, an admission): every member counts from 0 again."""
        self.calls = self.last_voted = self.voting = 0

    def report(self) -> dict:
        """What a recovery's report says of the gathers (steps.py's `_decide`)."""
        return {"gathers": self.calls, "gathered": self.last_voted,
                "gather_phase1": self.calls > 0 and self.voting == self.calls,
                "evaluation": self.batch}

    def gather(self, sampler, gather, empty, comm):
        """`px.gather_for_metrics` of a loader over `sampler` (None: over a stream): `gather()`
        on a whole wire, voted on; else `empty()`, the recovery run here first when it can."""
        key = sampler.gather_key() if sampler is not None else None
        if key is not None and (sampler.returned_whole(key) or sampler.refused()):
            return empty()  # returned whole before the batch was served again; or refused
        steps = self.steps
        n = out = None
        behind = self._model_behind(sampler) if not gate.cut and steps.decision is None else None
        if behind:  # every rank alike: the ledgers are the same on every member
            sampler.gather_lost(_BEHIND.format(behind))
            return empty()
        if not gate.cut and steps.decision is None:
            self.calls += 1
            n = self.calls
            out = gather()
            if not gate.cut and sampler is not None:
                self.voting = n
                if self._vote is None or self._vote.device != comm.device:
                    self._vote = torch.ones(1, device=comm.device)
                comm.all_reduce(self._vote.fill_(1.0), op="sum", tag="elastic:gather vote")
            if not gate.cut:
                self.last_voted = n
                if sampler is not None:
                    sampler.gathered_whole(key)
                return out
        if sampler is None:
            self._stream_lost()
            return empty()
        if steps.decision is not None:  # recovered already: the batch is served again
            sampler.gather_lost(None if steps.resume_due else _AHEAD)
            return empty()
        if self._step_in_flight(sampler):  # the recovery waits for its optimizer.step()
            sampler.gather_lost(_IN_FLIGHT)
            return empty()
        entered = n is not None and self.voting == n
        self.batch = sampler.batch_in_flight()
        try:
            decision = steps.recover_between_steps()
        finally:
            self.batch = None
        debug(f"gather {n} lost: last gathered {decision.gathered}, entered {entered}")
        whole = entered and decision.gathered >= n  # its vote completed on another survivor
        if whole:
            sampler.gathered_whole(key)
        if any(s.behind_last_step() for s in list(steps.samplers)):
            sampler.gather_lost(_WENT_BACK.format(os.path.basename(decision.checkpoint or "")))
            decision.evaluation = None  # not redone: the line says what the training redoes
        elif not whole:
            sampler.gather_lost(None if steps.resume_due else _AHEAD)
        return out if whole else empty()

    def _step_in_flight(self, sampler) -> bool:
        """Whether a training step has begun since the last optimizer.step(): a forward with
        gradients, or a batch of a loader other than an evaluation's."""
        return self.steps.stepping or any(
            s is not sampler and not s.evaluating and s.ledger is not None and s.ledger.unstepped
            for s in list(self.steps.samplers))

    def _model_behind(self, sampler) -> str | None:
        """What the model lacks of what the loop took ([Note: the ledger] in data/ledger.py):
        steps lost with a rank and not trained again yet (a redo waits for the loop's next
        training batch), or a reload from an older checkpoint. None: nothing."""
        if sampler is None:
            return None
        for s in list(self.steps.samplers):
            if s is not sampler and not s.evaluating and s.ledger is not None:
                wrong = s.ledger.mismatches()
                if wrong:
                    return wrong[0]
        return None

    def _stream_lost(self) -> None:
        if not self._said_stream:
            self._said_stream = True
            print(f"phalanx: rank {self.steps.m.rank}: a px.gather_for_metrics over a loader of "
                  "an IterableDataset lost a rank; a stream cannot serve a batch again, so "
                  "this evaluation is incomplete from here on (its gathers return nothing "
                  "until it ends): evaluate over a map-style dataset to have it redone",
                  file=sys.stderr, flush=True)

    def pass_ended(self, sampler) -> None:
        """A loader's pass ended: one whose gathers lost a batch it did not serve again says
        so (its result is incomplete)."""
        why = sampler.not_redone()
        if why is not None:
            sampler.loop_pass_begins()  # said once
            print(f"phalanx: rank {self.steps.m.rank}: an evaluation's px.gather_for_metrics "
                  f"results are incomplete: {why or _NOT_SERVED}", file=sys.stderr, flush=True)
