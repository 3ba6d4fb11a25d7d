"""The averaged gradient on its way under staleness=1, in a checkpoint.

Under `px.prepare(..., staleness=1)` the gradient averaged at step t is applied at step t+1
(see [Note: staleness=1] in engine/delayed.py), so after `optimizer.step()` one averaged
gradient is still to be applied: it is part of the training state. It is the same on every
rank, so it is stored like a parameter (see [Note: what a checkpoint stores] in state.py):
under `grad/<name>`, in element ranges of the pieces each rank holds, written by the rank
that writes the parameter, and read back at any world size and strategy into the pieces the
loading rank holds. Which parameters got a gradient on some rank is stored with the small
state (`delayed` in it); a parameter that got none has no `grad/` tensor and is not stepped.

A checkpoint with no `delayed` entry (saved with staleness=0, or before the first step) resumes
with nothing to apply at the next step. A model prepared without staleness drops the stored
gradient, with a warning.
"""

from __future__ import annotations

import warnings

import torch

from .state import ModelState, Range

__all__ = ["PREFIX", "delayed_ranges", "load_delayed"]

PREFIX = "grad/"


def _delayed(model_state: ModelState):
    engine = model_state.engine
    return engine.delayed if engine is not None else None


@torch.no_grad()
def delayed_ranges(model_state: ModelState, owner: dict) -> tuple[list[Range], dict | None]:
    """This rank's ranges of the gradient on its way, and what the small state keeps of it
    (the names of the parameters that have one); ([], None) when there is none."""
    delayed = _delayed(model_state)
    landed = delayed.pending() if delayed is not None else None
    if landed is None:
        return [], None
    used, out = [], []
    for unit, reduced, flags in landed:
        for i, p in enumerate(unit.params):
            if flags[i] and id(p) in model_state.names:
                used.append(model_state.names[id(p)])
        for piece in unit.pieces:
            name = model_state.names.get(id(unit.params[piece.param_index]))
            if name is None or not flags[piece.param_index] \
                    or not model_state.writes(name, owner):
                continue
            values = reduced[piece.lo:piece.hi].to(unit.master_dtype)
            out.append(Range(PREFIX + name, piece.start, piece.end, values))
    return out, {"used": sorted(set(used))}


@torch.no_grad()
def load_delayed(model_state: ModelState, reader, saved: dict | None) -> None:
    """Give the engine the stored gradient to apply at the next step (see the module's
    docstring); `saved` is the small state's `delayed` entry, or None."""
    delayed = _delayed(model_state)
    if delayed is None:
        if saved is not None and model_state.comm.rank == 0:
            warnings.warn("the checkpoint holds an averaged gradient still to be applied "
                          "(saved with staleness=1), and this model was prepared without "
                          "staleness: it is dropped", stacklevel=3)
        return
    if saved is None:
        delayed.restore(None)
        return
    used = set(saved["used"])
    landed = []
    for unit in model_state.engine.units:
        names = [model_state.names.get(id(p)) for p in unit.params]
        flags = [name in used for name in names]
        reduced = torch.zeros(unit.hi - unit.lo, dtype=unit.compute_dtype,
                              device=unit.bucket.device)
        for piece in unit.pieces:
            if flags[piece.param_index]:
                reader.read_into(PREFIX + names[piece.param_index], piece.start, piece.end,
                                 reduced[piece.lo:piece.hi])
        landed.append((unit, reduced, flags))
    delayed.restore(landed)
