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

import torch

__all__ = ["ROOTS", "GatherLog"]

ROOTS = -1  # the roots' signature exchange at the end of a forward (zero3_roots.py)
MOST = 1 << 16  # entries kept in one pass (forwards with gradients and no backward add up)


def _orders(gatherer) -> tuple:
    return tuple(gatherer._forward_order), tuple(gatherer._backward_order)


class GatherLog:
    """The collectives of a gatherer's group, this pass's and the last whole pass's."""

    def __init__(self):
        self.entries: list[int] = []   # unit indexes, and ROOTS
        self.began: tuple | None = None
        self.last: tuple | None = None  # (began, entries, ended) of the last whole pass

    def note(self, gatherer, entry: int) -> None:
        if not self.entries:
            self.began = _orders(gatherer)
        if len(self.entries) < MOST:
            self.entries.append(entry)
        else:  # too long a pass to keep: it, and the next, are unknown
            self.began = ()

    def close(self, gatherer) -> None:
        """The end of a pass's backward (its deferred gathers issued)."""
        if self.began == ():
            self.last = None
        elif self.entries:
            ended = (tuple(gatherer._forward_seen or gatherer._forward_order),
                     tuple(gatherer._backward_order))
            self.last = (self.began, self.entries, ended)
        self.entries, self.began = [], None

    def blocker(self, gatherer) -> str | None:
        """Why the rest of this pass cannot be known, or None (see the Note)."""
        if self.last is None:
            return "zero3 has not seen a whole step yet, so the gathers to come are unknown"
        began, entries, _ = self.last
        now = self.began if self.entries else _orders(gatherer)
        if began != now or entries[:len(self.entries)] != self.entries:
            return ("zero3 gathers in an order it has not settled yet (the first two steps, or "
                    "a model whose path changed), so the gathers to come are unknown")
        return None

    @torch.no_grad()
    def replay(self, gatherer) -> None:
        """Make the rest of the last whole pass's collectives (`blocker` said it may)."""
        _, entries, ended = self.last
        units = {u.index: u for u in gatherer.units}
        for entry in entries[len(self.entries):]:
            if entry == ROOTS:
                nobody = torch.full((2,), -1, dtype=torch.int64, device=gatherer.comm.device)
                gatherer.comm.all_gather_list(nobody, tag="zero3:roots")
                continue
            unit = units[entry]
            unit.wait_gathered()
            work = unit.unshard(gatherer.comm, async_op=True)
            if work is not None:
                work.wait()
            unit.reshard()
        gatherer._forward_order, gatherer._backward_order = list(ended[0]), list(ended[1])
        gatherer._forward_seen, gatherer._backward_seen = [], []
        gatherer._deferred = None  # issued by nobody: freeing would otherwise issue it
        gatherer._callback_queued = False
        gatherer._active.clear()
        gatherer._recomputed = []
        gatherer.free_all()
        self.entries, self.began = [], None
