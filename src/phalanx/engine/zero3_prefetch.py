"""zero3: gathering the next roots while one computes (a mixin of zero3.py's UnitGatherer).

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

__all__ = ["Prefetching"]


class Prefetching:
    """What `UnitGatherer` (zero3.py) gathers ahead; it holds the state these methods use
    (`roots`, `prefetch`, `limit`, `_deferred`, `_prefetched`, `freeing`)."""

    def _prefetch(self, order: list[int], seen: list[int], defer: bool = False) -> None:
        """See [Note: prefetch]: gather the roots that followed this one in `order` (with
        `defer`, once this root's units are freed: `reduced`)."""
        pos = len(seen) - 1
        if not self.prefetch or pos >= len(order) or order[pos] != seen[-1]:
            return  # no order yet, or this pass went another way: gather on demand
        gathered, chosen = self.gathered_bytes(), []
        for index in order[pos + 1:pos + 1 + self.prefetch]:
            need = self.roots[index].missing_bytes()
            if not need:
                continue
            if self.limit is not None and gathered + need > self.limit:
                break
            chosen.append(index)
            gathered += need
        if defer:
            self._deferred = (seen[-1], chosen) if chosen else None
        else:
            self._issue(chosen)

    def _issue(self, indices: list[int]) -> None:
        for index in indices:
            for unit in self.roots[index].units:
                if not unit.gathered:
                    unit.pending = self._unshard(unit)
            self._prefetched.add(index)
            self.prefetched += 1
        self.peak_bytes = max(self.peak_bytes, self.gathered_bytes())

    def flush(self) -> None:
        """Issue the deferred prefetch now (before any other gather, and at the end)."""
        if self._deferred is not None:
            chosen, self._deferred = self._deferred[1], None
            self._issue(chosen)

    def _flush_when_released(self) -> None:
        if self._deferred is None:
            return
        root = self.roots[self._deferred[0]]
        if not any(u.gathered and not self.freeing.waits_for_root(u, root) for u in root.units):
            self.flush()
