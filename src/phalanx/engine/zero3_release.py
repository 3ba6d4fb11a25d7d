"""zero3: when a unit gathered for backward may be freed again.

[Note: freeing a unit in backward]
A unit of trainable parameters only is freed as soon as its gradients are all out (the engine
launches its bucket: `UnitGatherer.reduced`): each of its parameters' gradients is complete, so
autograd has read every one of them for the last time in this backward. A unit that holds
frozen parameters ([Note: frozen parameters in a unit] in flat.py) has no such signal for them:
a frozen weight is read to make the gradient of its layer's input, possibly after its trainable
neighbours' gradients are complete (a LoRA block's frozen projection, beside its adapters). So
such a unit is freed once its own gradients are out (where it has any) and its root's backward
is over: the gradient of every input of the root's forward that needs one is made (FSDP2
frees a module's parameters after its backward the same way, from its inputs' gradients), for
every forward through the root since the last backward. Where the root's one such input is
another root's output (a block's hidden state, made by the block before it), that is seen in
the hook that gathers the other root for its backward, first thing, so a root is freed before
the next one is gathered; elsewhere by `torch.autograd.graph.register_multi_grad_hook` (mode
"all") on the inputs, which runs after the hooks registered on them before it. A root none of whose
inputs needs a gradient (the model itself, or the first block after a frozen embedding) keeps such
units until the end of the backward, where everything still gathered is freed; so does a root whose
forward was recomputed (activation checkpointing: its units are freed as the next recomputation
starts, as any recomputed root's are) or whose hook is not reached in this backward. Freeing later
than possible costs memory for a while, never a value: a root whose units were freed is gathered
again when backward reaches its outputs.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook

from .._tree import map_tensors

__all__ = ["BackwardRelease"]


class BackwardRelease:
    """The bookkeeping of the Note for one gatherer (zero3.py), reset at each backward's end."""

    def __init__(self, on_root_done):
        self._on_root_done = on_root_done  # fn(root): the root's backward is over
        self._open: dict[int, int] = {}    # root index -> forwards whose backward is not over
        self._done: set[int] = set()       # roots whose backward is over in this backward
        self._out: set[int] = set()        # units whose gradients are out in this backward
        # id(a root's output) -> (a weak reference to it, the roots whose one input it is)
        self._outputs: dict[int, tuple] = {}

    def watch(self, root, args, kwargs) -> None:
        """After a forward of `root` that records gradients (not a recomputation): hook the
        end of its backward, where its units hold frozen parameters."""
        if not root.holds_frozen:
            return
        inputs: list[torch.Tensor] = []
        map_tensors(lambda t: inputs.append(t) if isinstance(t, torch.Tensor)
                    and t.requires_grad else None, (args, kwargs))
        if not inputs:
            return
        self._open[root.index] = self._open.get(root.index, 0) + 1
        known = self._outputs.get(id(inputs[0])) if len(inputs) == 1 else None
        if known is not None and known[0]() is inputs[0]:
            known[1].append(root)
        else:
            register_multi_grad_hook(inputs, lambda _grads: self._backward_through(root),
                                     mode="all")

    def output(self, t: torch.Tensor) -> int:
        """`t`, an output of a root that gathers the root when its gradient arrives: its key
        for `gradient_of`."""
        self._outputs[id(t)] = (weakref.ref(t), [])
        return id(t)

    def gradient_of(self, key: int) -> None:
        """From the gather hook of the root output `key`: its gradient is made."""
        entry = self._outputs.pop(key, None)
        for root in entry[1] if entry is not None else ():
            self._backward_through(root)

    def _backward_through(self, root) -> None:
        left = self._open.get(root.index, 0) - 1
        if left > 0:
            self._open[root.index] = left
            return
        self._open.pop(root.index, None)
        self._done.add(root.index)
        self._on_root_done(root)

    def may_free(self, unit, root) -> bool:
        """Whether `unit` of `root` may be freed now (see the Note); from its gradients'
        launch (`gradients_out`) and from the end of its root's backward."""
        if not unit.frozen:
            return True
        return root.index in self._done and (not unit.params or unit.index in self._out)

    def gradients_out(self, unit) -> None:
        self._out.add(unit.index)

    def waits_for_root(self, unit, root) -> bool:
        """Gathered only for frozen parameters whose root's backward is not over: what a
        deferred prefetch need not wait for (it follows within the root's backward)."""
        return bool(unit.frozen) and (not unit.params or unit.index in self._out) \
            and root.index not in self._done

    def forward_starts(self) -> None:
        """Before a forward of the prepared model: what a backward that raised left is not
        this pass's (the forwards still to be backpropagated stay counted: a root of an earlier
        forward whose output is forgotten here is freed at the end of the backward)."""
        self._done.clear()
        self._out.clear()
        self._outputs.clear()

    def reset(self) -> None:
        """The end of a backward: nothing of it is awaited any more."""
        self._open.clear()
        self._done.clear()
        self._out.clear()
        self._outputs.clear()
