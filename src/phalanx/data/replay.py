"""The part of `DistributedSampler` that steps redone under `phalanx run --on-failure continue`
need, a part the sampler owns (`sampler.replay`): where the last committed step left the order,
going back there (or to a sharded engine's checkpoint) after a rank is lost, leaving out the
lost steps' batches when a replay reaches them, and the ledger that checks the result
(ledger.py). continuing/steps.py drives it through `commit_step`, `rewind_to` and
`resume_after_loss` (the protocol `Replayable` below), and `ledger.step_called` at every
`optimizer.step()`; continuing/gathers.py, through the `gather_*` methods, an evaluation's
batch in flight ([Note: an evaluation redone] there).

The part keeps its own state (what was committed, where a reload sends training back, the
parts of the order left out, the loop's epoch while a replay catches up, an evaluation's
gathers) and reads its sampler's place in the order (`epoch`, `position()`,
`global_batch_size`, `dataset_length`, `_end(start)`, `_pass_began()`); it moves the sampler
one way only, `_restart_at(epoch, start)`: the next pass begins there, the loader starting its
iteration again. The sampler asks it where a pass jumps and how much of an epoch is left out.
"""

from __future__ import annotations

from typing import Protocol

from ..comm import continuation
from .ledger import Ledger

__all__ = ["Replayable", "Replay"]


class Replayable(Protocol):
    """What continue mode (continuing/steps.py) asks of a sampler that it replays after a rank is
    lost; a `DistributedSampler`'s `Replay` part is one. The part registers itself with continue
    mode when it is made (comm/continuation.py's `replay`), and keeps a ledger from then on."""

    ledger: object  # its Ledger (ledger.py), which counts what the loop was served
    evaluating: bool  # px.gather_for_metrics was given its loader: a step takes no batch of it

    def commit_step(self) -> None:
        """Every rank committed the step: a redo goes back no further than here."""

    def rewind_to(self, state: dict) -> None:
        """A sharded engine reloaded the checkpoint holding this sampler's `state`: the next
        resume starts there, keeping what the lost steps consumed."""

    def resume_after_loss(self, skip: bool) -> None:
        """The lost steps are thrown away: the next pass starts where the last committed step
        left the order (with `skip`, where the lost steps left it), the loader starting its
        iteration again. An evaluation's sampler goes back to its batch in flight instead."""

    def gather_key(self) -> tuple:
        """A `px.gather_for_metrics` of this sampler's loader begins: its place, the same on
        every rank (the batch the loop holds, and how many gathers of it came before)."""

    def returned_whole(self, key: tuple) -> bool:
        """Whether the gather at `key` returned every rank's values already (a redo then
        returns nothing there)."""

    def gathered_whole(self, key: tuple) -> None:
        """The gather at `key` returned every rank's values."""

    def batch_in_flight(self) -> int:
        """The batch the loop holds, counted from 0 at the start of the epoch's order."""

    def gather_lost(self, refused: str | None = None) -> None:
        """A gather returned nothing: its batch is to be served again; `refused`: it will not
        be, for that reason, nor will the rest of the pass be gathered."""

    def refused(self) -> bool:
        """Whether the pass's gathers return nothing from here on (see `gather_lost`)."""

    def not_redone(self) -> str | None:
        """Why a gather of the pass returned nothing and its batch was not served again (""
        where no reason was given; None: none was lost, or every one was redone)."""

    def behind_last_step(self) -> bool:
        """Whether a sharded engine's reload sent training back before the last step every
        rank committed (the steps since are redone at the resume)."""

    def loop_pass_begins(self) -> None:
        """A loader's iteration over this sampler begins (the loop's `for`, not a restart
        after a loss): no gather of it has returned anything yet."""


class Replay:
    """A `DistributedSampler`'s part for continue mode (see the module docstring): made with
    its sampler (`sampler.replay`), under continue mode or not, since a state saved or loaded
    carries what a replay left out either way."""

    def __init__(self, sampler):
        self.sampler = sampler
        self._committed = (0, 0)  # (epoch, position) at the last step all ranks committed
        self._redo_from = None    # where a sharded engine's reload sent training back
        self._left_out: list = []  # (epoch, from, to): global order skipped after a replay
        self._through = None      # the loop's epoch while a replay stands in an earlier one
        self._replay_until = None  # (epoch, position) where the loop stood when it was sent back
        # An evaluation's gathers ([Note: an evaluation redone] in continuing/gathers.py)
        self._current = None      # (epoch, position) of the batch the loop holds
        self._gathers_of_batch = 0  # px.gather_for_metrics calls made for it so far
        self._whole: set = set()  # the loop pass's gathers returned whole: (epoch, pos, k)
        self._redo_pending = False  # a gather returned nothing and its batch is not redone yet
        self._refused = None      # why this pass's gathers return nothing from here on
        self.evaluating = False   # px.gather_for_metrics was given this sampler's loader
        self.ledger = None        # See [Note: the ledger] in ledger.py: under continue mode
        if continuation.now().replay(self):  # continue mode drives it from here on
            self.ledger = Ledger()

    # -- the order as a replay leaves it (asked by the sampler) ---------------------------------
    def skipped(self, start: int, upto: int, epoch: int | None = None) -> int:
        """Samples of the epoch's order (the sampler's by default) from `start` to before `upto`
        left out (see [Note: a step redone])."""
        epoch = self.sampler.epoch if epoch is None else epoch
        return sum(to - frm for e, frm, to in self._left_out if e == epoch and start <= frm < upto)

    def after_skips(self, start: int, pos: int) -> int:
        """`pos` moved past every part left out that a pass from `start` reached by then."""
        for epoch, frm, to in sorted(self._left_out):
            if epoch == self.sampler.epoch and start <= frm <= pos:
                pos += to - frm
        return pos

    def jumps(self) -> dict:
        """The parts of the sampler's epoch a pass leaves out: where each begins -> ends."""
        return {frm: to for epoch, frm, to in self._left_out if epoch == self.sampler.epoch}

    def left_to_catch_up(self) -> int:
        """Samples of the whole epochs a replay passes through before the loop's own."""
        end = self.sampler._end(0)
        return sum(end - self.skipped(0, end, epoch)
                   for epoch in range(self.sampler.epoch + 1, (self._through or 0) + 1))

    def loop_epoch(self) -> int:
        """The epoch of the loop's pass: the one a replay is on its way to, else the sampler's."""
        return self.sampler.epoch if self._through is None else self._through

    def catching_up(self) -> bool:
        """Whether a replay stands in an epoch before the loop's (see [Note: a step redone]):
        at the end of this pass the loader goes on with the next epoch's."""
        return self._through is not None and self.sampler.epoch < self._through

    def catching_up_to(self, epoch: int) -> bool:
        """Whether `epoch` is the loop's, which a replay is carrying the pass into (the loop's
        `set_epoch` of it then keeps the replay's place)."""
        return epoch == self._through

    def next_epoch(self, epoch: int) -> None:
        """A pass ended and the sampler went on to `epoch`: what was left out before it is
        behind, and a replay that reached the loop's epoch has caught up."""
        self._left_out = [j for j in self._left_out if j[0] >= epoch]
        if self._through is not None and epoch >= self._through:
            self._through = None

    def epoch_set(self, epoch: int) -> None:
        """The loop set another epoch than the sampler's and the one a replay heads for: what
        was left out before it is behind, and no replay is under way."""
        self._left_out = [j for j in self._left_out if j[0] >= epoch]
        self._through = None

    def state(self, consumed: int) -> dict:
        """What the sampler's state (`state_dict`, at `consumed` of its epoch) adds for a
        replay: the parts left out that it has not reached yet, the loop's epoch while a replay
        stands in an earlier one, and the ledger's counts (ledger.py)."""
        state: dict = {}
        epoch = self.sampler.epoch
        ahead = [list(j) for j in sorted(self._left_out)
                 if j[0] > epoch or (j[0] == epoch and j[1] >= consumed)]
        if ahead:  # a replay's batches left out and not reached yet
            state["left_out"] = ahead
        if self._through is not None:
            state["through"] = self._through
        if self.ledger is not None:
            state["ledger"] = self.ledger.rows()
        return state

    def load(self, state: dict) -> None:
        """The sampler loaded `state` (`load_state_dict`; it stands at its place already): the
        last committed step is there, and a load begins the ledger's counts again from the
        state's."""
        epoch = self.sampler.epoch
        self._committed = self._next_from(epoch, int(state["consumed"]))
        self._redo_from = None
        self._left_out = [tuple(int(v) for v in j) for j in state.get("left_out", [])]
        through = state.get("through")
        self._through = int(through) if through is not None and through > epoch else None
        self._replay_until = None
        if self.ledger is not None:
            self.ledger.load(state.get("ledger"))

    # -- the loop is served ----------------------------------------------------------------------
    def batch_consumed(self, at: tuple) -> None:
        """The loop is about to be served the pass's batch `at` (epoch, position, size): the
        ledger counts it, as a replay's while the replay has not reached where the loop stood
        (`_replay_until`); an evaluation's gathers are of this batch from now on."""
        if self.ledger is None:
            return
        fresh = self._replay_until is None or at[:2] >= self._replay_until
        if fresh:
            self._replay_until = None
        self.ledger.served(at[0], at[2], fresh)
        self._current, self._gathers_of_batch = (self.sampler.epoch, self.sampler.position()), 0

    def loop_pass_ends(self, began_in: int) -> None:
        """A loader's pass the loop began in epoch `began_in` came to its end: in that epoch,
        unless a replay went astray, which the ledger reports."""
        if self.ledger is not None and self.sampler.epoch != began_in:
            self.ledger.astray.append(f"a pass the loop began in epoch {began_in} ended in "
                                       f"epoch {self.sampler.epoch}")

    # -- what continue mode drives (`Replayable`) -----------------------------------------------
    def _where(self) -> tuple[int, int]:
        return self._next_from(self.sampler.epoch, self.sampler.position())

    def _next_from(self, epoch: int, consumed: int) -> tuple[int, int]:
        """(epoch, position) where the next step begins: a position with no step left in its
        epoch is the start of the next epoch."""
        return (epoch + 1, 0) if self.sampler._end(consumed) <= consumed else (epoch, consumed)

    def commit_step(self) -> None:
        """A step every rank committed: a redo goes back no further than here."""
        self._committed = self._where()
        if self.ledger is not None:
            self.ledger.committed()

    def resume_after_loss(self, skip: bool) -> None:
        """[Note: a step redone]
        Under `phalanx run --on-failure continue` the steps after the last one every rank
        committed are thrown away when a rank is lost (continuing/steps.py); the next pass starts
        where that step left the global order (or, with `skip`, where the lost steps left it),
        and the loader begins its iteration again, splitting each global batch over the ranks
        there are now.

        A sharded engine goes back further, to its newest checkpoint (`_redo_from`, set by
        `rewind_to` instead of a load: the order the lost steps consumed is still needed). Then
        the steps from there to the last committed one are trained again, and with `skip` the
        lost steps' part of the order is left out when the replay reaches it (`_left_out`):
        the result is the same as skipping those batches where they fell.

        The place to go back to can lie in an epoch the loop has finished: a checkpoint saved
        before the last step of epoch e, reloaded after the loop went on to epoch e + 1 (its
        `set_epoch` called, its `for x, y in loader` begun). The loader's iteration in progress
        is then the loop's epoch e + 1, and it must not end where epoch e ends (that lost the
        whole of epoch e + 1 once): `_through` holds the loop's epoch, and the loader goes on
        from the end of each replayed epoch to the next (`catching_up`) until it stands in
        the loop's epoch again, so this one iteration serves the rest of epoch e and then all
        of epoch e + 1, as the uninterrupted run's two iterations did. Nor may it go past the
        loop's epoch: the last committed step (or, with `skip`, the last lost one) can be the
        last of the epoch whose pass is still in progress, and the place after it, the next
        epoch's start, is then where that pass ends, not one to serve the next epoch from
        (that served it twice: inside this pass, and again after the loop's `set_epoch`). The
        ledger (ledger.py) checks that the redo served exactly what was thrown away.

        A sampler whose batches never came before a step (an evaluation's: `ledger.trained`)
        holds nothing the model must have: it goes back only to its batch in flight, inside the
        pass in progress, and not at all between passes (sent back to the last committed step,
        it served a finished evaluation pass again inside the next: each sample twice). See
        [Note: an evaluation redone] in continuing/gathers.py."""
        if self.ledger is not None and not self.ledger.trained:
            self._evaluation_resumes()
            return
        lost_end = self._where()
        loop_epoch = self.loop_epoch()
        start = self._committed if self._redo_from is None else self._redo_from
        self._redo_from = None
        if skip and start == self._committed:
            start = lost_end
        elif skip and lost_end != self._committed:
            (e0, p0), (e1, p1) = self._committed, lost_end
            if e0 == e1:
                self._left_out.append((e0, p0, p1))
            else:  # the lost steps ran over the end of an epoch
                self._left_out.append((e0, p0, self.sampler.dataset_length))
                if p1:
                    self._left_out.append((e1, 0, p1))
        if start[0] > loop_epoch:  # the loop's pass is at its end: it ends there
            start = (loop_epoch, self.sampler.dataset_length)
        if self.ledger is not None:
            self.ledger.thrown_away(skip)
            until = self._replay_until
            self._replay_until = lost_end if until is None else max(until, lost_end)
        self._committed = start
        self._through = loop_epoch if start[0] < loop_epoch else None
        self.sampler._restart_at(*start)

    # -- an evaluation's batch in flight ([Note: an evaluation redone] in continuing/gathers.py) --
    def _evaluation_resumes(self) -> None:
        """`resume_after_loss` of a sampler no step took a batch of: the pass in progress
        serves its batch in flight again, split over the ranks there are now."""
        self.ledger.thrown_away(False)
        self._redo_pending = False
        self._redo_from = None
        began = self.sampler._pass_began()
        if began is None:  # between passes: nothing of it is lost
            return
        at, epoch = self._current, self.sampler.epoch
        if at is None or at[0] != epoch or at[1] < began:
            at = (epoch, began)  # no batch of this pass reached the loop
        self._committed = at
        self.sampler._restart_at(*at)

    def loop_pass_begins(self) -> None:
        self._whole.clear()
        self._redo_pending, self._refused = False, None
        self._current = None

    def gather_key(self) -> tuple:
        self.evaluating = True
        epoch, pos = self._current if self._current is not None else (
            self.sampler.epoch, self.sampler.position())
        self._gathers_of_batch += 1
        return (epoch, pos, self._gathers_of_batch - 1)

    def returned_whole(self, key: tuple) -> bool:
        return key in self._whole

    def gathered_whole(self, key: tuple) -> None:
        self._whole.add(key)

    def gather_lost(self, refused: str | None = None) -> None:
        self._redo_pending = True
        self._refused = self._refused or refused

    def refused(self) -> bool:
        return self._refused is not None

    def not_redone(self) -> str | None:
        if self._refused is not None:
            return self._refused
        return "" if self._redo_pending else None

    def behind_last_step(self) -> bool:
        return self._redo_from is not None and self._redo_from != self._committed

    def batch_in_flight(self) -> int:
        pos = self._current[1] if self._current is not None else self.sampler.position()
        return pos // self.sampler.global_batch_size

    def rewind_to(self, state: dict) -> None:
        """A sharded engine reloaded the checkpoint holding `state` after a loss: training goes
        back there at the next resume (see `resume_after_loss`), and so does the ledger's `done`."""
        self._redo_from = self._next_from(int(state["epoch"]), int(state["consumed"]))
        if self.ledger is not None:
            self.ledger.rewound(state.get("ledger"))
