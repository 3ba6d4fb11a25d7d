"""zero3: a unit's full parameters exist only while the unit computes.

[Note: zero3's gather and free]
Between steps each rank holds only its shard of every unit (the master, and the optimizer
state of it). A unit's *root* is the module whose forward brackets every use of its parameters:
the repeated block it belongs to (units.py), else the model's token embedding or output layer
when it sits in one (`get_input_embeddings()`, `get_output_embeddings()`: units.py's
`own_roots`), else the model's child that
contains every module registering one of its parameters, else the model (a parameter
registered in two modules, such as tied input and output embeddings, lifts the root to their
common ancestor, so it stays whole while both use it; see `_callable_root`). Hooks on each
root:

- before its forward: every unit rooted there is gathered (`unit.unshard`, an all-gather of the
  shards into the full buffer the parameters are views of);
- after its forward: those units are freed (the full buffer's storage is resized to zero; the
  parameters stay views of it), and, when gradients are recorded, a hook on the root's outputs
  gathers them again when backward reaches them, before the root's backward needs the values
  that autograd saved (the saved tensors are views of the same storage, so they see the
  gathered values again). Not freed: the units rooted at the model itself, with which backward
  starts (they are gathered through the whole forward anyway), the root the last forward
  ended with when this forward reaches it last too (backward begins there, so freeing it
  would only gather it again at once; FSDP2 keeps its root module's parameters for the same
  reason), every unit under `reshard_after_forward=False`, and a root recomputed inside
  backward (activation checkpointing) until the next root's recomputation starts: its
  backward may be about to read it (a checkpointed block is recomputed after its output's
  hook gathered it), and a root whose hook has not fired yet in this backward is freed then
  and gathered again by that hook, so a segment of many blocks checkpointed at once holds two
  besides what is prefetched;
- when a unit's gradients are all there, the reducer sends them out (reduced to the owned
  shard, as zero2 does, from the tensor autograd made where the unit is one parameter) and
  the unit is freed at once (see [Note: prefetch] in zero3_prefetch.py for what is waited for when;
  a unit holding frozen parameters also waits for its root's backward to be over: [Note: freeing a
  unit in backward] in zero3_release.py); at the end of the outermost backward (queued from the
  prepared model's output node, so a reentrant checkpoint's nested backward does not end it) every
  unit still gathered is freed (one that got no gradient on this rank, or under `no_sync`).

A module inside a root, called while that root's forward is not running, is refused with an
error naming both (it would compute on freed storage, or on whatever happens to be gathered),
unless the model's forward (or a backward) is running: see [Note: a root whose module is not
called] in zero3_roots.py.

[Note: two sequences of collectives]
A unit's gradients are reduced when they are all there, which can differ between ranks: a
parameter used on one rank only (a branch on the rank inside one root) makes its unit ready
mid-backward there and only at the end of backward elsewhere. The reducer keeps its own
sequence the same everywhere (units go out in a fixed order, each once every rank has it),
but a gather issued in backward between two reductions on one rank and after both on another
would meet a reduction on the wire and hang. So the gathers run on a process group of their
own (`comm.apart("zero3:gathers")`): the reductions form one sequence, the gathers another,
each the same on every rank (and logged: [Note: replaying a pass's gathers] in zero3_replay.py).

[Note: every rank runs the same roots] is in zero3_roots.py: a forward whose roots differ
between ranks is found at the end of the backward, before the step, and named on every rank.

[Note: a forward without gradients]
A forward of the model under `torch.no_grad()` (evaluation, `generate`; decided when the model's
own forward starts, so blocks a reentrant checkpoint runs under no_grad inside a training
forward gather as usual) gathers no unit collectively: each
root's units are read from the peers' shards one-sidedly (engine/remote.py), one root at a
time, and freed when the root's forward ends, so one rank can evaluate or generate alone while
the others train on or wait (nanoGPT evaluates inside `if master_process:`). Such a forward
leaves the orders that prefetching follows alone and is not compared across ranks. Every rank
evaluating at once works the same way: each reads the others' shards point to point (the same
bytes an all-gather moves, with a round trip through the store per unit and peer).

Writing the gathered values into the buffer does not count as modifying the parameters for
autograd: each parameter keeps its own version counter (it was given the view with
`param.data = ...`), so the saved tensors stay valid.

The optimizer steps the masters; nothing is gathered after the step: the next forward gathers
what it needs.

[Note: prefetch] is in zero3_prefetch.py: what is gathered ahead, and when.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.autograd import Variable

from .._tree import map_tensors
from .units import unit_roots
from .zero3_prefetch import Prefetcher
from .zero3_release import BackwardRelease
from .zero3_replay import ROOTS, GatherLog
from .zero3_roots import RootChecks, guard_modules

__all__ = ["UnitGatherer"]


def _in_backward() -> bool:
    """Inside a backward pass (a recomputation under activation checkpointing runs there)."""
    return torch._C._current_graph_task_id() != -1


class _Root:
    """The units one module's forward brackets (see [Note: zero3's gather and free])."""

    def __init__(self, index: int, name: str, units: list):
        self.index = index
        self.name = name
        self.units = units
        self.is_model = name == ""
        self.holds_frozen = any(u.frozen for u in units)

    def missing_bytes(self) -> int:
        return sum(u.full_bytes for u in self.units if not u.gathered)


class UnitGatherer:
    """The hooks of [Note: zero3's gather and free] and [Note: prefetch] for one model.

    prefetch: how many roots ahead to gather while the current one computes (0: none).
    max_gathered_bytes: a bound on the full parameters gathered at once; prefetching stops
        short of it (a root needed now is gathered whatever its size).
    reshard_after_forward: False keeps each unit gathered from its forward to its backward
        (less communication, more memory); the model's own root always stays (see the Note).
    finish_reductions: fn() the engine's, run before a root's backward makes its gradients:
        the reductions issued before it are finished where safe (see [Note: waiting for a
        reduction in backward] in reducer.py), or None.
    fetch: fn(unit) -> its whole buffer read from the peers (engine/remote.py): how a forward
        without gradients gathers, with no collective, so that one rank may run it alone; None
        gathers collectively there too.
    """

    def __init__(self, module: nn.Module, units, comm, *, prefetch: int = 1,
                 max_gathered_bytes: int | None = None, reshard_after_forward: bool = True,
                 block_classes=None, finish_reductions: Callable[[], None] | None = None,
                 fetch: Callable | None = None):
        self.comm = comm
        self.units = list(units)
        self.prefetch = prefetch
        self.limit = max_gathered_bytes
        self.reshard_after_forward = reshard_after_forward
        modules = dict(module.named_modules(remove_duplicate=False))
        by_root: dict[str, list] = {}
        runs = [u.members for u in self.units]  # frozen parameters too (flat.py)
        for unit, root in zip(self.units, unit_roots(module, runs, block_classes)):
            by_root.setdefault(root, []).append(unit)
        self.roots = [_Root(i, name, units_here)
                      for i, (name, units_here) in enumerate(by_root.items())]
        hooks = self._hooks = []  # removed by `release` (continuing/: a rebuilt engine)
        for root in self.roots:
            hooks.append(modules[root.name].register_forward_pre_hook(self._before(root)))
            hooks.append(modules[root.name].register_forward_hook(self._after(root),
                                                                  with_kwargs=True))
        hooks.append(module.register_forward_hook(self._forward_done))  # after the roots' own
        # Whether the model's (outermost) forward records a graph: a reentrant activation
        # checkpoint runs its blocks under no_grad inside a training forward, and those gather
        # collectively like the rest of it (see [Note: a forward without gradients]).
        self._grad_forward = True
        hooks.append(module.register_forward_pre_hook(self._model_forward_starts, prepend=True))
        hooks += guard_modules(modules, self.roots, self.units, self.entered)  # outside its root
        self.in_forward = False  # the model's (outermost) forward is running
        self._late: set[int] = set()  # roots entered at a use of their parameters (zero3_roots)
        self._active: set[int] = set()        # roots whose forward is running
        self._recomputed: list[int] = []      # roots kept after a recomputation in backward
        self._callback_queued = False  # the end-of-backward free is queued
        self._forward_seen: list[int] = []    # roots in the order this forward reached them
        self._forward_order: list[int] = []   # ... and the last complete forward's
        self._backward_seen: list[int] = []
        self._backward_order: list[int] = []
        self.peak_bytes = 0                   # the most full parameters gathered at once
        self.checks = RootChecks(comm, self.roots)  # [Note: every rank runs the same roots]
        self.finish_reductions = finish_reductions
        self.fetch = fetch
        # this pass's collectives, the last pass's (zero3_replay.py)
        self.log = GatherLog(began=self._orders, ended=self._ended_orders)
        self.freeing = BackwardRelease(self._root_backward_done)  # zero3_release.py
        self.prefetcher = Prefetcher(self.roots, prefetch, max_gathered_bytes,
                                     unshard=self._unshard, gathered_bytes=self.gathered_bytes,
                                     after_issue=self._note_peak,
                                     waits_for_root=self.freeing.waits_for_root)
        self._root_of = {id(u): r for r in self.roots for u in r.units}

    @property
    def prefetched(self) -> int:
        """Roots gathered ahead so far (counted for tests and reports)."""
        return self.prefetcher.count

    @property
    def prefetched_unused(self) -> int:
        """... and of them, those freed without being used."""
        return self.prefetcher.unused

    def release(self) -> None:
        """Take this gatherer's hooks off the model (its engine is being replaced)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def oversized(self) -> list[tuple[str, int]]:
        """Roots bigger than the bound on their own: (name, bytes)."""
        sizes = [(r.name or "the model", sum(u.full_bytes for u in r.units)) for r in self.roots]
        return [(n, size) for n, size in sizes if self.limit is not None and size > self.limit]

    def gathered_bytes(self) -> int:
        return sum(u.full_bytes for u in self.units if u.gathered)

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.gathered_bytes())

    def gather(self, units) -> None:
        if any(not u.gathered for u in units):
            self.prefetcher.flush()  # every rank issues its gathers in one order
        works = [self._unshard(u) for u in units if not u.gathered]
        for unit in units:
            unit.wait_gathered()
        for work in works:
            if work is not None:
                work.wait()
        self._note_peak()

    def _unshard(self, unit):
        self.log.note(unit.index)
        return unit.unshard(self.comm, async_op=True)

    def free_all(self) -> None:
        self.prefetcher.flush()
        for unit in self.units:
            unit.reshard()
        self.prefetcher.drop()

    # -- the orders a pass follows, as the log of its collectives keeps them (zero3_replay.py)
    def _orders(self) -> tuple:
        """The orders this pass follows: the last forward's and the last backward's."""
        return tuple(self._forward_order), tuple(self._backward_order)

    def _ended_orders(self) -> tuple:
        """The orders a whole pass leaves, at its backward's end."""
        return tuple(self._forward_seen or self._forward_order), tuple(self._backward_order)

    def replay_blocker(self) -> str | None:
        """Why this rank cannot make the rest of the pass's gathers, or None (see [Note:
        replaying a pass's gathers] in zero3_replay.py)."""
        return self.log.blocker()

    def replay(self) -> None:
        """Make the rest of the last whole pass's gathers (`replay_blocker` said it may), then
        stand where the others stand after the pass: the orders they learnt from it, nothing
        gathered (see [Note: replaying a pass's gathers] in zero3_replay.py)."""
        forward, backward = self.log.replay(self.comm, self.units)
        self._forward_order, self._backward_order = list(forward), list(backward)
        self._forward_seen, self._backward_seen = [], []
        self.prefetcher.forget_deferred()  # issued by nobody: freeing would otherwise issue it
        self._callback_queued = False
        self._active.clear()
        self._recomputed = []
        self.free_all()

    def forward_starts(self) -> None:
        """Before each forward of the prepared model: the last forward's order is the one to
        prefetch in; what a forward without backward, or a prefetch never used, left gathered
        is freed; and a backward that raised before its end (see [Note: a backward that
        raised] in reducer.py) no longer counts as under way."""
        if self._forward_seen:
            self._forward_order, self._forward_seen = self._forward_seen, []
        self._callback_queued = False
        self._backward_seen = []
        self._active.clear()  # a forward that raised
        self._recomputed = []
        self.freeing.forward_starts()
        self.free_all()

    def backward_started(self) -> None:
        """From the prepared model's output node: the end of this (outermost) backward frees
        what is left (see the Note)."""
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _model_forward_starts(self, _module, _args):
        self._grad_forward = torch.is_grad_enabled()
        self.in_forward = True

    def entered(self, root: _Root) -> bool:
        """Whether `root`'s forward is running, or `root` was entered now at a use of its
        parameters (`enter_late`): the check of zero3_roots.py's guard."""
        return root.index in self._active or self.enter_late(root)

    def enter_late(self, root: _Root) -> bool:
        """See [Note: a root whose module is not called] in zero3_roots.py: gather `root` at
        a use of its parameters, where the model's forward (or a backward) runs; False where
        neither does."""
        if not (self.in_forward or _in_backward()):
            return False
        self._late.add(root.index)
        self._before(root)(None, ())
        return True

    def _forward_done(self, _module, _args, _output):
        self.in_forward = False
        for index in self._late:  # kept for backward as the model's own, else freed now
            self._active.discard(index)
            for unit in self.roots[index].units if not torch.is_grad_enabled() else ():
                unit.reshard()
        self._late.clear()
        if self.comm.world > 1 and torch.is_grad_enabled():
            seen = list(self._forward_seen)
            self.log.note(ROOTS)  # see [Note: replaying a pass's gathers]
            self.checks.compare(seen)
        for index in self.prefetcher.drop():  # the forward took another path than the last one
            for unit in self.roots[index].units:
                unit.reshard()

    def take_checks(self) -> list:
        """The (roots seen, same on every rank) of the forwards since the last backward."""
        return self.checks.take()

    def raise_if_differed(self, checks: list, same: list) -> None:
        self.checks.raise_if_differed(checks, same)

    def reduced(self, unit) -> None:
        """From the engine: every gradient of `unit` is out, it may be freed (see [Note:
        freeing a unit in backward]). The deferred prefetch goes once its root holds nothing
        gathered but frozen parameters: in backward the next root is gathered while this one's
        gradients are reduced, not while they are made (see [Note: prefetch])."""
        self.freeing.gradients_out(unit)
        if self.freeing.may_free(unit, self._root_of[id(unit)]):
            unit.reshard()
        self.prefetcher.flush_when_released()

    def _root_backward_done(self, root) -> None:
        for unit in root.units:
            if self.freeing.may_free(unit, root):
                unit.reshard()
        self.prefetcher.flush_when_released()

    def _before(self, root: _Root):
        def hook(_module, _args):
            self._active.add(root.index)
            self.prefetcher.used(root.index)
            recomputing = _in_backward()
            if not self._grad_forward and not recomputing and self.fetch is not None:
                for unit in root.units:  # see [Note: a forward without gradients]
                    if not unit.gathered:
                        unit.fill(self.fetch(unit))
                return
            if recomputing:  # activation checkpointing: see the Note
                hooked = set(self._backward_seen)
                for index in self._recomputed:
                    if index not in hooked and index != root.index:
                        for unit in self.roots[index].units:
                            unit.reshard()
                self._recomputed = []
            self.gather(root.units)
            if not recomputing:
                self._forward_seen.append(root.index)
                self.prefetcher.plan(self._forward_order, self._forward_seen)
        return hook

    def _after(self, root: _Root):
        def hook(_module, args, kwargs, output):
            self._active.discard(root.index)
            grad = torch.is_grad_enabled()
            recomputed = grad and _in_backward()
            # Kept: the model's own root and the last one (backward starts with them),
            # everything when asked, and a recomputed root until the next recomputation
            # starts (see the Note).
            keep = grad and (root.is_model or not self.reshard_after_forward or recomputed
                             or self._ends_forward(root))
            if recomputed and not root.is_model:
                self._recomputed.append(root.index)
            if not keep:
                for unit in root.units:
                    unit.reshard()
            if grad:
                map_tensors(lambda t: self._watch_output(t, root), output)
                if not recomputed:
                    self.freeing.watch(root, args, kwargs)
            return None
        return hook

    def _ends_forward(self, root: _Root) -> bool:
        """This forward has reached the same roots as the last one so far, and the last one
        ended with `root`."""
        order, seen = self._forward_order, self._forward_seen
        return (not _in_backward() and len(seen) == len(order) and bool(order)
                and order[-1] == root.index and seen[-1] == root.index)

    def _watch_output(self, t, root):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(self._before_backward(root, self.freeing.output(t)))
        return t

    def _before_backward(self, root: _Root, key: int):
        def hook(grad):
            self.freeing.gradient_of(key)  # the roots whose input it is are done with it
            self.prefetcher.used(root.index)
            self.gather(root.units)
            self.backward_started()  # in case backward began elsewhere than at the output node
            seen = self._backward_seen
            if not seen or seen[-1] != root.index:  # a root's several outputs: once
                if self.finish_reductions is not None:  # the reductions before it, where safe
                    self.finish_reductions()
                seen.append(root.index)
                self.prefetcher.plan(self._backward_order, seen, defer=True)
            return grad
        return hook

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._recomputed = []
        self.freeing.reset()
        if self._backward_seen:
            self._backward_order, self._backward_seen = self._backward_seen, []
        self.free_all()
        self.log.close()
