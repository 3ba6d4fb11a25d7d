"""What the loop was served and what the model holds, per epoch, under `phalanx run
--on-failure continue`: the check that a recovery lost nothing and trained nothing twice.

[Note: the ledger]
A recovery throws steps away (the step in flight; under zero1/2/3 every step since the
checkpoint the survivors reload) and sends the samplers back, so that the loop is served those
batches again (replay.py's [Note: a step redone]). That this adds up is checked, not assumed:
each sampler's ledger keeps, per epoch of its order, two counts of (samples, optimizer steps):

- due: what an uninterrupted run of the same loop has trained by now. A batch counts when the
  loop, served it for the first time, calls `optimizer.step()` after it; served again by a
  replay it does not count again. A batch a recovery leaves out (a rank raised in its step)
  is taken off, as the run it is compared with skipped it.
- done: what the model holds. A batch counts when the step after it commits (the vote,
  continuing/steps.py), and goes back with the model: to the last committed step when steps are
  thrown away, to the checkpoint's counts (kept in the sampler's state) when a sharded engine
  reloads one.

An uninterrupted run has due == done after every step. After a recovery the lost part is due
and not done until the replay serves it again and its steps commit. So at the end of every pass
the loop takes to its end (`px.data_loader`) and at the end of the job (`px.shutdown`), an epoch
whose counts differ is an error that names it and both counts, and the job ends non-zero
instead of completing with weights an uninterrupted run would not have. Every member counts the
same global samples and steps, so every member finds it at the same point. A pass of the loop
that ends in another epoch than it began in is reported the same way: a replay that ran on
into the next epoch inside the loop's pass would have the loop take that epoch twice, in
counts that balance.

A step's batches are those the sampler that served last before `optimizer.step()` served since
the step before, an evaluation's aside (a sampler whose loader `px.gather_for_metrics` was
given: `evaluating`): an evaluation loader's batches, served between two training batches or
between a training batch and its step, belong to no step and are not counted. A sampler none of
whose batches ever came before a step (an evaluation's: `trained` stays False) is therefore
never behind, and a recovery sends it back only inside the pass in progress, to the batch in
flight, never across the end of a pass it finished (replay.py; [Note: an evaluation redone] in
continuing/gathers.py). A load (`px.load`, a replacement's admission) starts both counts from the
loaded state's.
"""

from __future__ import annotations

import itertools

__all__ = ["Ledger", "step_called"]

_serial = itertools.count(1)  # orders the batches every sampler of this process serves


def _add(counts: dict, epoch: int, samples: int, steps: int) -> None:
    row = counts.setdefault(epoch, [0, 0])
    row[0] += samples
    row[1] += steps


class Ledger:
    """One sampler's counts (see the Note); a `DistributedSampler`'s replay part (replay.py)
    holds one under continue mode."""

    def __init__(self):
        self.due: dict[int, list] = {}    # epoch -> [samples, steps] an uninterrupted run has
        self.done: dict[int, list] = {}   # epoch -> [samples, steps] the model holds
        self.unstepped: list = []    # (epoch, samples, fresh) served since the last step call
        self.uncommitted: list = []  # per step called and not committed: its batches
        self.back_to: list | None = None  # a reloaded checkpoint's counts, due at the resume
        self.astray: list[str] = []  # passes that ended in another epoch than they began in
        self.last = 0                # when this sampler last served a batch (_serial)
        self.trained = False         # a step was called after a batch of its (or it was loaded)

    # -- what the loop and the steps do -------------------------------------------------------
    def served(self, epoch: int, samples: int, fresh: bool) -> None:
        """The loop is served a batch; `fresh`: for the first time (not a replay)."""
        self.unstepped.append((epoch, samples, fresh))
        self.last = next(_serial)

    def called(self, stepped: bool) -> None:
        """`optimizer.step()` is called; `stepped`: after a batch of this sampler's."""
        batches, self.unstepped = self.unstepped, []
        if not stepped or not batches:
            return
        self.trained = True
        self.uncommitted.append(batches)
        fresh = [b for b in batches if b[2]]
        for epoch, samples, _ in fresh:
            _add(self.due, epoch, samples, 0)
        if fresh:
            _add(self.due, fresh[-1][0], 0, 1)

    def committed(self) -> None:
        """Every member committed the step called last: the model holds its batches."""
        for batches in self.uncommitted:
            for epoch, samples, _ in batches:
                _add(self.done, epoch, samples, 0)
            _add(self.done, batches[-1][0], 0, 1)
        self.uncommitted = []

    def rewound(self, rows: list | None) -> None:
        """The model went back to a checkpoint holding these counts (None: none known); they
        replace `done` at the resume, after which the replay counts again."""
        self.back_to = list(rows or [])

    def thrown_away(self, skip: bool) -> None:
        """The resume after a recovery: the steps called since the last commit are thrown away
        (and, with `skip`, their batches left out for good: no longer due)."""
        if skip:
            for batches in self.uncommitted:
                for epoch, samples, _ in batches:
                    _add(self.due, epoch, -samples, 0)
                _add(self.due, batches[-1][0], 0, -1)
        self.uncommitted, self.unstepped = [], []
        if self.back_to is not None:
            self.done = self._counts(self.back_to)
            self.back_to = None

    # -- state ------------------------------------------------------------------------------------
    def rows(self) -> list:
        """`done` for a sampler's state: [[epoch, samples, steps], ...]."""
        return [[epoch, *row] for epoch, row in sorted(self.done.items())]

    def load(self, rows: list | None) -> None:
        """A load: both counts start from the loaded state's (none: from nothing)."""
        self.done = self._counts(rows or [])
        self.due = self._counts(rows or [])
        self.unstepped, self.uncommitted, self.back_to = [], [], None
        self.trained = self.trained or bool(rows)

    @staticmethod
    def _counts(rows: list) -> dict:
        return {int(epoch): [int(samples), int(steps)] for epoch, samples, steps in rows}

    # -- the check --------------------------------------------------------------------------------
    def mismatches(self) -> list[str]:
        """Each epoch whose counts differ, and each pass that ended in another epoch than it
        began in (a replay that served an epoch the loop then asked for again), in words;
        empty when the ledger balances."""
        out = list(self.astray)
        for epoch in sorted(set(self.due) | set(self.done)):
            due, done = self.due.get(epoch, [0, 0]), self.done.get(epoch, [0, 0])
            if due != done:
                out.append(f"epoch {epoch}: the loop took {_counted(*due)}, the model holds "
                           f"{_counted(*done)}")
        return out


def _counted(samples: int, steps: int) -> str:
    return f"{samples} samples in {steps} optimizer step{'' if steps == 1 else 's'}"


def step_called(samplers) -> None:
    """`optimizer.step()` is called: it takes the batches of the sampler that served last, an
    evaluation's aside (see the Note); `samplers`: their replay parts (replay.py's
    `Replayable`)."""
    counted = [s for s in samplers if s.ledger is not None]
    training = [s.ledger for s in counted if not s.evaluating]
    latest = max(training, key=lambda ledger: ledger.last, default=None)
    for s in counted:
        s.ledger.called(s.ledger is latest and latest.last > 0)
