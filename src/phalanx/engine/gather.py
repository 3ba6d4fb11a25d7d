"""zero3: a unit's full parameters exist only while the unit computes.

[Note: zero3's gather and free]
Between steps each rank holds only its shard of every unit (the master, and the optimizer
state of it). A unit's *root* is the module whose forward brackets every use of its parameters:
the repeated block it belongs to (units.py), else the model's child that contains every
module registering one of its parameters, else the model (a parameter registered in two
modules, such as tied input and output embeddings, lifts the root to their common ancestor, so
it stays whole while both use it; see `_callable_root`). Hooks on each root:

- before its forward: every unit rooted there is gathered (`unit.unshard`, an all-gather of the
  shards into the full buffer the parameters are views of);
- after its forward: those units are freed (the full buffer's storage is resized to zero; the
  parameters stay views of it), and, when gradients are recorded, a hook on the root's outputs
  gathers them again when backward reaches them, before the root's backward needs the values
  that autograd saved (the saved tensors are views of the same storage, so they see the
  gathered values again);
- when a unit's gradients are all there, the reducer sends them out (reduced to the owned
  shard, as zero2 does) and the unit is freed at once; at the end of backward every unit still
  gathered is freed (one that got no gradient on this rank, or under `no_sync`).

Writing the gathered values into the buffer does not count as modifying the parameters for
autograd: each parameter keeps its own version counter (it was given the view with
`param.data = ...`), so the saved tensors stay valid.

The optimizer steps the masters; nothing is gathered after the step: the next forward gathers
what it needs. A parameter used outside the forward of every module that registers it (read
through an attribute by an unrelated module) is not gathered there: register it in the module
that uses it, as with PyTorch's FSDP.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Variable

from .._tree import map_tensors
from .units import find_blocks

__all__ = ["UnitGatherer"]


def _owners(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> the qualified names of the modules that register it."""
    owners: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for p in sub._parameters.values():
            if p is not None:
                owners.setdefault(id(p), [])
                if name not in owners[id(p)]:
                    owners[id(p)].append(name)
    return owners


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") if n else [] for n in names]
    common = []
    for level in zip(*parts):
        if all(x == level[0] for x in level):
            common.append(level[0])
        else:
            break
    return ".".join(common)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _callable_root(common: str, blocks: list[str], modules: dict) -> str:
    """The module whose forward brackets every use of a unit's parameters.

    The common ancestor of the registering modules is not always called: torch's own
    MultiheadAttention reads `out_proj.weight` in its forward without calling `out_proj`. So
    the root is lifted to the repeated block the unit sits in (units.py never mixes blocks),
    else to the model's child that holds it (an element, for a child that is a container),
    else the model itself."""
    for block in blocks:
        if common == block or common.startswith(block + "."):
            return block
    parts = common.split(".") if common else []
    if not parts:
        return ""
    if isinstance(modules[parts[0]], _CONTAINERS):
        return ".".join(parts[:2]) if len(parts) >= 2 else ""
    return parts[0]


class UnitGatherer:
    """The hooks of [Note: zero3's gather and free] for one model."""

    def __init__(self, module: nn.Module, units, comm):
        self.comm = comm
        self.units = list(units)
        owners = _owners(module)
        modules = dict(module.named_modules(remove_duplicate=False))
        names_of = {id(m): n for n, m in modules.items()}
        blocks = [names_of[id(b)] for b in find_blocks(module)]
        by_root: dict[str, list] = {}
        for unit in self.units:
            names = [n for p in unit.params for n in owners.get(id(p), [""])]
            root = _callable_root(_common_prefix(names), blocks, modules)
            by_root.setdefault(root, []).append(unit)
        root_of = {}
        for name, units_here in by_root.items():
            root = modules[name]
            root.register_forward_pre_hook(self._before(units_here))
            root.register_forward_hook(self._after(units_here))
            root_of.update({id(u): name for u in units_here})
        # A module inside a root, called on its own, would compute on freed storage: it gets
        # an error that says so instead (a check of a flag per call).
        unit_of = {id(p): u for u in self.units for p in u.params}
        for name, sub in modules.items():
            mine = {id(unit_of[id(p)]): unit_of[id(p)] for p in sub._parameters.values()
                    if p is not None and id(p) in unit_of}
            if any(root_of[k] != name for k in mine):
                sub.register_forward_pre_hook(self._guard(name, list(mine.values()), root_of))
        self._callback_queued = False

    def gather(self, units) -> None:
        works = [u.unshard(self.comm, async_op=True) for u in units if not u.gathered]
        for work in works:
            if work is not None:
                work.wait()

    def free_all(self) -> None:
        for unit in self.units:
            unit.reshard()

    def forget_unfinished_backward(self) -> None:
        """Before a forward: a backward that raised before its end (see [Note: a backward
        that raised] in reducer.py) left its end-of-backward free queued in vain; free what it
        gathered, and let the next backward queue it again."""
        if self._callback_queued:
            self._callback_queued = False
            self.free_all()

    @staticmethod
    def _guard(name, units, root_of):
        def hook(_module, _args):
            for unit in units:
                if not unit.gathered:
                    root = root_of[id(unit)] or "the model"
                    raise RuntimeError(
                        f"zero3: module {name!r} was called on its own, but its parameters "
                        f"are gathered only during the forward of {root!r} (between uses each "
                        "rank keeps 1/N of them); call the prepared model instead, or prepare "
                        "with strategy='zero2', which keeps whole parameters")
        return hook

    def _before(self, units):
        def hook(_module, _args):
            self.gather(units)
        return hook

    def _after(self, units):
        def hook(_module, _args, output):
            for unit in units:
                unit.reshard()
            if torch.is_grad_enabled():
                map_tensors(lambda t: self._watch_output(t, units), output)
            return None
        return hook

    def _watch_output(self, t, units):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(self._before_backward(units))
        return t

    def _before_backward(self, units):
        def hook(grad):
            self.gather(units)
            if not self._callback_queued:  # free whatever is left at the end of backward
                self._callback_queued = True
                Variable._execution_engine.queue_callback(self._end_of_backward)
            return grad
        return hook

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.free_all()
