"""The part of `DistributedSampler` that steps redone under `phalanx run --on-failure continue`
need: where the last committed step left the order, going back there (or to a sharded engine's
checkpoint) after a rank is lost, and leaving out the lost steps' batches when a replay reaches
them. elastic/steps.py drives it through `_commit`, `_rewind` and `_resume`.
"""

from __future__ import annotations

__all__ = ["Replays"]


class Replays:
    """Mixed into `DistributedSampler` (sampler.py), whose state it reads and moves: `epoch`,
    `_start`, the pass in progress, `_committed`, `_redo_from` and `_left_out`."""

    def _skipped(self, start: int, upto: int) -> int:
        """Samples of this epoch's order from `start` to before `upto` left out (see
        [Note: a step redone])."""
        return sum(to - frm for epoch, frm, to in self._left_out
                   if epoch == self.epoch and start <= frm < upto)

    def _after_skips(self, start: int, pos: int) -> int:
        """`pos` moved past every part left out that a pass from `start` reached by then."""
        for epoch, frm, to in sorted(self._left_out):
            if epoch == self.epoch and start <= frm <= pos:
                pos += to - frm
        return pos

    def _where(self) -> tuple[int, int]:
        return self._next_from(self.epoch, self.position())

    def _next_from(self, epoch: int, consumed: int) -> tuple[int, int]:
        """(epoch, position) where the next step begins: a position with no step left in its
        epoch is the start of the next epoch."""
        return (epoch + 1, 0) if self._end(consumed) <= consumed else (epoch, consumed)

    def _commit(self) -> None:
        """A step every rank committed: a redo goes back no further than here."""
        self._committed = self._where()

    def _resume(self, skip: bool) -> None:
        """[Note: a step redone]
        Under `phalanx run --on-failure continue` the steps after the last one every rank
        committed are thrown away when a rank is lost (elastic/steps.py); the next pass starts
        where that step left the global order (or, with `skip`, where the lost steps left it),
        and the loader begins its iteration again, splitting each global batch over the ranks
        there are now.

        A sharded engine goes back further, to its newest checkpoint (`_redo_from`, set by
        `_rewind` instead of a load: the order the lost steps consumed is still needed). Then
        the steps from there to the last committed one are trained again, and with `skip` the
        lost steps' part of the order is left out when the replay reaches it (`_left_out`):
        the result is the same as skipping those batches where they fell."""
        lost_end = self._where()
        start = self._committed if self._redo_from is None else self._redo_from
        self._redo_from = None
        if skip and start == self._committed:
            start = lost_end
        elif skip and lost_end != self._committed:
            (e0, p0), (e1, p1) = self._committed, lost_end
            if e0 == e1:
                self._left_out.append((e0, p0, p1))
            else:  # the lost steps ran over the end of an epoch
                self._left_out.append((e0, p0, self.dataset_length))
                if p1:
                    self._left_out.append((e1, 0, p1))
        self._committed = start
        self._continuing = None
        self.epoch, self._start = start
        self._pass_start, self._steps_done, self._in_pass = self._start, 0, False
        self.restart = True

    def _rewind(self, state: dict) -> None:
        """A sharded engine reloaded the checkpoint holding `state` after a loss: training goes
        back there at the next resume (see `_resume`)."""
        self._redo_from = self._next_from(int(state["epoch"]), int(state["consumed"]))
