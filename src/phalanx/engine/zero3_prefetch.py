"""zero3: gathering the next roots while one computes (a part of zero3.py's UnitGatherer).

[Note: prefetch]
A gather waits for the slowest rank and the wire; issued early, it can proceed while the root
before it computes. Each forward records the order in which it reached the roots, and each
backward the order in which its output hooks fired. When a root starts (in forward or
backward), the roots that followed it last time, up to `prefetch` of them and within
`max_gathered_bytes` counting everything gathered now, are gathered asynchronously (the work
handle waits on the unit: `unit.pending`, waited for before the unit is used or freed). In
backward they are chosen then but gathered once the root's units are freed (its gradients
out), and before the root makes its gradients the reductions issued before it are finished
where safe ([Note: waiting for a reduction in backward] in reducer.py): a root's gradients
then meet only its own parameters, and the next root's gather runs beside their reduction,
so beyond the shards a rank holds two units' worth at most (measured: 1.14x the ZeRO formula
on 8 blocks of 64 MiB, where prefetching at the root's start and reducing during the next one
held four; benchmarks/anchors.py). A deferred gather is issued before any other gather.
Every rank runs the same model, so every rank issues the same all-gathers in the same order. When
this pass departs from the last one (a block skipped), the roots no longer line up position
by position and prefetching stops until they do again; roots are gathered on demand; what was
gathered for nothing is freed at the end of the forward (or of backward), so a changing order
costs time, never correctness or memory beyond the bound. The first step has no order yet and
prefetches nothing. A parameter used outside the forward of every module that registers it
(read through an attribute by an unrelated module) is not gathered there: register it in the
module that uses it, as with PyTorch's FSDP.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["Prefetcher"]


class Prefetcher:
    """What one `UnitGatherer` (zero3.py) gathers ahead (see [Note: prefetch]).

    roots: the gatherer's roots, by index. depth: how many roots ahead to gather (0: none).
    limit: max_gathered_bytes, a bound on the full parameters gathered at once, or None.
    unshard: fn(unit) -> the unit's all-gather, issued on the gatherer's group (and logged:
        zero3_replay.py).
    gathered_bytes: fn() -> the full parameters gathered now.
    after_issue: fn(), called once a prefetch is on the wire (the gatherer's peak).
    waits_for_root: fn(unit, root) -> whether the unit is gathered only for frozen parameters
        whose root's backward is not over (zero3_release.py's `waits_for_root`).
    """

    def __init__(self, roots: list, depth: int, limit: int | None, *,
                 unshard: Callable, gathered_bytes: Callable[[], int],
                 after_issue: Callable[[], None], waits_for_root: Callable):
        self.roots = roots
        self.depth = depth
        self.limit = limit
        self._unshard = unshard
        self._gathered_bytes = gathered_bytes
        self._after_issue = after_issue
        self._waits_for_root = waits_for_root
        self.ahead: set[int] = set()  # roots gathered ahead and not used yet
        self.deferred = None  # backward: (root, roots to prefetch once its units are freed)
        self.count = 0        # roots gathered ahead (counted for tests/reports)
        self.unused = 0       # ... and freed without being used

    def plan(self, order: list[int], seen: list[int], defer: bool = False) -> None:
        """See [Note: prefetch]: gather the roots that followed this one in `order` (with
        `defer`, once this root's units are freed: `flush_when_released`)."""
        pos = len(seen) - 1
        if not self.depth or pos >= len(order) or order[pos] != seen[-1]:
            return  # no order yet, or this pass went another way: gather on demand
        gathered, chosen = self._gathered_bytes(), []
        for index in order[pos + 1:pos + 1 + self.depth]:
            need = self.roots[index].missing_bytes()
            if not need:
                continue
            if self.limit is not None and gathered + need > self.limit:
                break
            chosen.append(index)
            gathered += need
        if defer:
            self.deferred = (seen[-1], chosen) if chosen else None
        else:
            self._issue(chosen)

    def _issue(self, indices: list[int]) -> None:
        for index in indices:
            for unit in self.roots[index].units:
                if not unit.gathered:
                    unit.pending = self._unshard(unit)
            self.ahead.add(index)
            self.count += 1
        self._after_issue()

    def flush(self) -> None:
        """Issue the deferred prefetch now (before any other gather, and at the end)."""
        if self.deferred is not None:
            chosen, self.deferred = self.deferred[1], None
            self._issue(chosen)

    def flush_when_released(self) -> None:
        """Issue the deferred prefetch once its root holds nothing gathered but frozen
        parameters whose root's backward is not over."""
        if self.deferred is None:
            return
        root = self.roots[self.deferred[0]]
        if not any(u.gathered and not self._waits_for_root(u, root) for u in root.units):
            self.flush()

    def used(self, index: int) -> None:
        """Root `index` is used now: what was gathered ahead for it was not for nothing."""
        self.ahead.discard(index)

    def drop(self) -> set[int]:
        """Forget the roots gathered ahead and not used (counted as unused); returns them, for
        the caller to free."""
        dropped, self.ahead = self.ahead, set()
        self.unused += len(dropped)
        return dropped

    def forget_deferred(self) -> None:
        """A deferred prefetch is issued by nobody (a replayed pass: zero3_replay.py)."""
        self.deferred = None
