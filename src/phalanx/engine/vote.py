"""The per-step vote: an exception in one rank's step drops that step on every rank.

[Note: the step vote]
When one rank's forward or backward raises (an out-of-memory error, caught by the loop as
fairseq's is: `except torch.OutOfMemoryError: optimizer.zero_grad(); continue`), the other
ranks are already in the step: blocked in its collectives, which that rank will not make. So
the failing rank makes them after all, and says in them that it failed; every rank then drops
the step's gradients, nobody leaves, and training goes on at full size, as one process that
skipped the batch.

- Seen: a forward of the prepared model that raised (model/prepared.py tells `forward_raised`),
  and a backward that reached the model's outputs and never got to its end (the reducer is
  still `in_progress()`). An exception in the loss, before its backward reaches the model, is
  not seen: phalanx cannot tell it from a forward whose backward is still to come; nor is one
  raised in the end of backward itself after this rank's last bucket went out (the others
  have read a healthy step by then).
- Made up: at this rank's next call into its model (a forward, `zero_grad()` of the model or
  an adopted optimizer, `optimizer.step()`, `px.clip_grad_norm_`, a GradScaler's unscale),
  whichever the loop reaches first, `catch_up` completes the step's collectives in their
  order: under zero3 first the gathers the other ranks make in the rest of the pass (replayed
  from the last whole pass: [Note: replaying a pass's gathers] in zero3_replay.py), then the
  buckets not yet launched (a gradient that never arrived goes as zeros), each carrying this
  rank's signal (buckets.py) raised by `fail_value`, then the end of backward as on every rank.
- Carried: the signal slot already rides in every bucket's collective, holding each rank's
  non-finite flag (0 or 1, faults/nonfinite.py) and reduced as a mean. A failing rank adds
  2 x (ranks in the job), so the mean is at least 2 where some rank failed and at most 1
  otherwise, also after shard_size's second average over the replicas (hybrid.py) and in
  bf16. The last bucket in launch order is launched only at the end of backward (reducer.py),
  so a backward that raised always leaves at least one to carry the vote.
- Decided: in the step's one host read ([Note: one host read per step] in flat_engine.py),
  the same on every rank. A voted-down step drops its gradients everywhere (its non-finite and
  zero3 same-roots checks go with it: what differed there was the failing rank's), the ranks
  then name who failed in one small all-gather (only in such a step), and rank 0 warns.
- After it: until the next backward (or forward with gradients), `optimizer.step()` changes
  nothing, counts no step, runs none of its watchers and makes no collective on any rank
  (continue mode's commit vote, continuing/steps.py, included: nobody is removed); nor do
  `px.clip_grad_norm_` and a GradScaler's unscale. So the ranks stay in step whether the
  failing rank's loop skips its `optimizer.step()` (`continue`) or goes on to it.
- Accumulation: a micro-step under `no_sync` communicates nothing, so a failure there is kept
  (`failing`) and said by the backward that next communicates: that whole step is dropped.

A healthy step pays nothing for this: no extra collective, no extra host read (the signal
slot was there), the same bytes per step as before the vote was added (measured in
docs/guides/failures.md; tests/test_step_vote.py checks that the step after a vote sends what
a healthy one does). In a world of one a step that raised only loses its gradients.

What the loop itself keeps per rank after `optimizer.step()` (an LR scheduler, GradScaler's
scale, a step counter) follows the loop: the ranks whose step did not raise go on through it,
so a failing rank that skips it with `continue` ends one step behind there
(docs/guides/failures.md).

A rank that cannot make the rest of the step (zero3 in its first two steps, or a layer or
option with collectives or per-rank state of its own: see `blocker`) raises an error instead
that says so, which should end it; the others then fail in their collective, or go on without
it under `phalanx run --on-failure continue`.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch

__all__ = ["FAILED_AT", "StepVote", "StepFailed"]

FAILED_AT = 1.5  # a reduced signal of at least this: some rank's step raised


class StepFailed(RuntimeError):
    """This rank's `optimizer.step()` raised while the other ranks applied theirs, and the
    loop called into the model again: this rank's parameters and optimizer state are no longer
    the others', so it cannot go on. Let the exception end the rank (under `phalanx run
    --on-failure continue` the others go on and redo the steps after it). `step`: the
    optimizer steps taken before it."""
    # see [Note: a step that raised in the optimizer] below

    def __init__(self, step: int, what: str):
        super().__init__(
            f"this rank's optimizer.step() at step {step} raised ({what}), and the loop went on "
            "past it; the other ranks applied that step, so this rank's parameters and optimizer "
            "state are no longer theirs and it cannot go on. Let the exception end this rank "
            "(under phalanx run --on-failure continue the others then go on without it and its "
            "replacement joins with their state), or end the run and resume from a checkpoint")
        self.step = step


def _described(exc: BaseException | None) -> str:
    if exc is None:
        return "an exception in its backward"
    return f"{type(exc).__name__}: {exc}"[:300]


class StepVote:
    """One engine's part in the vote (see the Note)."""

    def __init__(self, engine, job_world: int):
        self.engine = engine
        self.fail_value = 2.0 * job_world
        self.raised: BaseException | None = None  # a forward that raised, until caught up
        self.raised_sync = True
        self.failing: str | None = None  # this rank's failure while its signal says so
        self.dropped = False  # the last backward that communicated was voted down
        self.unavailable: str | None = None  # set by the prepared model (sync batchnorm)
        self._busy = False
        # [Note: a step that raised in the optimizer]: the step in progress, until it returns
        self.in_step: int | None = None
        self.step_raised: str | None = None

    @contextlib.contextmanager
    def stepping(self):
        """Around an `optimizer.step()` (see [Note: a step that raised in the optimizer]): the
        step is in progress until it returns. One that leaves by an exception every rank raises
        alike (a non-finite loss under on_nonfinite='raise': the step was dropped everywhere)
        leaves the replicas equal, so the loop may go on past it; so does one from a forward or
        backward run inside the step (a closure's), which the vote drops on every rank at this
        rank's next call (`catch_up`); any other is this rank's alone."""
        self.check_stepped()
        self.in_step, self.step_raised = self.engine.steps.value, None
        try:
            yield
        except BaseException as exc:
            if getattr(exc, "raised_on_every_rank", False) or self.raised is not None \
                    or self.engine.reducer.in_progress():
                self.in_step = None
            else:
                self.step_raised = f"{type(exc).__name__}: {exc}"[:300]
            raise
        self.in_step = None

    def check_stepped(self) -> None:
        """[Note: a step that raised in the optimizer]
        The vote drops a step whose forward or backward raised on some rank: every rank is
        still in the step's collectives then. An `optimizer.step()` that raises on one rank is
        past them: under ddp the other ranks have applied the step by the time this one has
        raised (the step makes no collective), and under zero1/zero2 they wait in its last
        collectives, the publishing of each rank's updated shard (which the failing rank still
        makes, with what it holds, before the exception leaves the step: engine/stepping.py).
        Dropping the step everywhere would need every rank's state from before it, a copy of
        the masters and optimizer state kept at every step; a healthy step pays nothing here.
        So the failing rank cannot go on: its step is still `in_step` when the loop calls into
        its model again (a forward, zero_grad, the next step, px.save, state_dict), which
        raises `StepFailed` naming the exception, so a loop that caught it ends the rank
        rather than train on with replicas that differ (silently, under ddp) or wait in a
        collective the others are past (zero2: a hang report 200 s later that did not name the
        exception). Uncaught, the exception ends the rank at once. Under `phalanx run
        --on-failure continue` the others then go on without it: the step it raised in was
        committed by every rank's vote, so the steps after it are redone, not skipped
        (continuing/steps.py). A call made while the step is still running (the forward and
        backward of a closure the optimizer calls, as Lightning's loop passes one) is no
        failure: only a step that has raised is one."""
        if self.in_step is not None and self.step_raised is not None:
            raise StepFailed(self.in_step, self.step_raised)

    def signal(self, base):
        """What this rank's bucket signal carries: `base` (the non-finite flag) plus the vote."""
        return base + self.fail_value if self.failing is not None else base

    def forward_raised(self, exc: BaseException) -> None:
        self.raised, self.raised_sync = exc, self.engine.reducer.sync

    def blocker(self) -> str | None:
        """Why this rank could not make the rest of a step, or None."""
        engine = self.engine
        if self.unavailable is not None:
            return self.unavailable
        if engine.delayed is not None:
            return "staleness=1 applies each step's gradients at the next one"
        if engine.compression is not None:
            return ("gradient compression keeps error-feedback state on each rank that the "
                    "dropped step would still change")
        if engine.gatherer is not None:
            return engine.gatherer.replay_blocker()
        return None

    def catch_up(self) -> None:
        """If this rank's last forward or backward raised, make the rest of its collectives,
        the vote in them (see the Note)."""
        self.check_stepped()
        engine, reducer = self.engine, self.engine.reducer
        if self._busy or (self.raised is None and not reducer.in_progress()):
            return
        in_backward = reducer.in_progress()
        exc = self.raised if self.raised is not None else sys.exc_info()[1]
        sync = reducer.pass_sync if in_backward else self.raised_sync
        self.raised = None
        if engine.world == 1:  # nobody to tell (a single process, DiLoCo's inner steps)
            reducer.abandon()
            engine.drop_grads()
            return
        why = self.blocker()
        if why is not None:
            reducer.drain()
            reducer.abandon()
            raise RuntimeError(
                f"this rank's step raised ({_described(exc)}) while the other ranks were in "
                f"it, and it cannot drop the step on every rank here: {why}. The others wait "
                "for this step's collectives, so let this error end this rank (under phalanx "
                "run --on-failure continue the others then go on without it), or end the run "
                "and resume from a checkpoint")
        self._busy = True
        try:
            self.failing = _described(exc)
            if engine.gatherer is not None:
                engine.gatherer.replay()
            if sync:
                reducer.end_backward()  # on to the engine's end of backward: voted_down
            else:  # said by the next backward that communicates
                reducer.abandon()
                engine.free_unreduced()
        finally:
            self._busy = False

    def voted_down(self, comm) -> None:
        """Every rank, at the end of a backward some rank's signal said failed: drop the step
        and name who failed (`comm`: the job's)."""
        engine = self.engine
        mine, self.failing = self.failing, None
        said = comm.all_gather_object(mine, tag="vote:ranks") if comm.world > 1 else [mine]
        engine.drop_grads()
        self.dropped = True
        if comm.rank == 0:
            who = "; ".join(f"rank {r} raised {what}" for r, what in enumerate(said) if what)
            warnings.warn(
                f"step {engine.steps.value}: {who or 'a rank raised'}. The step is dropped on "
                "every rank (its gradients thrown away, optimizer.step() changes nothing) and "
                "training goes on", RuntimeWarning, stacklevel=2)

    def zero(self, like: torch.Tensor | None) -> torch.Tensor:
        """The norm `px.clip_grad_norm_` returns for a dropped step."""
        return torch.zeros((), dtype=like.dtype if like is not None else torch.float32,
                           device=like.device if like is not None else None)
