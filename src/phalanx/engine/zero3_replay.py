"""zero3: the rest of a pass's gathers, made by a rank whose forward or backward raised in it.

[Note: replaying a pass's gathers]
Under zero3 the other ranks go on gathering units through the rest of a pass (forward and
backward) after one rank's forward or backward raised, each gather a collective that rank must
join for the step to be voted down ([Note: the step vote] in vote.py). Which gathers a pass
makes, in which order, follows from the model's path and from the orders the gatherer learnt
in the last pass (what it prefetches, which root it keeps for the backward: [Note: prefetch]
in zero3_prefetch.py); a static model makes the same ones pass after pass once the orders stop
changing (from its third pass: the first has no orders, the second has them for the first time). So
each rank keeps the sequence of collectives of its gathers' group in the pass under way (a unit's
all-gather by its index, or the roots' signature exchange of zero3_roots.py) with the orders it
began from, and the last whole pass's. A rank that failed makes what the last pass made after the
point it reached, each gather waited for and freed at once, when this pass began from the same
orders and has made the same collectives so far; otherwise it cannot know what the others make, and
says so (vote.py) rather than guess.

Were the others' pass to differ after all, the ranks would not go on with different values:
a gather of another unit of the same size gives parameters of a step that is dropped anyway,
and one of another size, or one more or one fewer, leaves a rank waiting, which the hang
report names. The rank then stands where the others stand after the pass: the orders they
learnt from it, nothing gathered.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["ROOTS", "GatherLog"]

ROOTS = -1  # the roots' signature exchange at the end of a forward (zero3_roots.py)
MOST = 1 << 16  # entries kept in one pass (forwards with gradients and no backward add up)


class GatherLog:
    """The collectives of a gatherer's group, this pass's and the last whole pass's.

    began: fn() -> the gatherer's orders now (forward's, backward's: what its prefetching and
        keeping follow), which a pass begins from.
    ended: fn() -> the orders a whole pass leaves (what the others learnt from it).
    """

    def __init__(self, began: Callable[[], tuple], ended: Callable[[], tuple]):
        self._began_now = began
        self._ended_now = ended
        self.entries: list[int] = []   # unit indexes, and ROOTS
        self.began: tuple | None = None
        self.last: tuple | None = None  # (began, entries, ended) of the last whole pass

    def note(self, entry: int) -> None:
        if not self.entries:
            self.began = self._began_now()
        if len(self.entries) < MOST:
            self.entries.append(entry)
        else:  # too long a pass to keep: it, and the next, are unknown
            self.began = ()

    def close(self) -> None:
        """The end of a pass's backward (its deferred gathers issued)."""
        if self.began == ():
            self.last = None
        elif self.entries:
            self.last = (self.began, self.entries, self._ended_now())
        self.entries, self.began = [], None

    def blocker(self) -> str | None:
        """Why the rest of this pass cannot be known, or None (see the Note)."""
        if self.last is None:
            return "zero3 has not seen a whole step yet, so the gathers to come are unknown"
        began, entries, _ = self.last
        now = self.began if self.entries else self._began_now()
        if began != now or entries[:len(self.entries)] != self.entries:
            return ("zero3 gathers in an order it has not settled yet (the first two steps, or "
                    "a model whose path changed), so the gathers to come are unknown")
        return None

    @torch.no_grad()
    def replay(self, comm, units: list) -> tuple:
        """Make the rest of the last whole pass's collectives (`blocker` said it may) on the
        gatherer's `comm`, each of `units` gathered, waited for and freed at once; returns the
        orders that pass ended with, for the gatherer to stand where the others stand."""
        _, entries, ended = self.last
        by_index = {u.index: u for u in units}
        for entry in entries[len(self.entries):]:
            if entry == ROOTS:
                nobody = torch.full((2,), -1, dtype=torch.int64, device=comm.device)
                comm.all_gather_list(nobody, tag="zero3:roots")
                continue
            unit = by_index[entry]
            unit.wait_gathered()
            work = unit.unshard(comm, async_op=True)
            if work is not None:
                work.wait()
            unit.reshard()
        self.entries, self.began = [], None
        return ended
