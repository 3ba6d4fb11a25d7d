"""The parts' state in a checkpoint: every feature that runs beside the strategy (the engine's
parts and the prepared model's, `ModelState.parts`), saved and loaded through engine/part.py's
interface, none of them named here (see [Note: a part in a checkpoint] in engine/part.py).
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch

from ..engine.part import Range
from ..engine.part_kinds import KINDS
from .state import ModelState, OptimizerState

__all__ = ["part_ranges", "keep_small", "load_parts"]

# the frames a part's warning passes over: phalanx's, and torch's (a no_grad decorator's)
_INSIDE = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
           os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


class _Saving:
    """engine/part.py's `Saving`: what a save tells a part."""

    def __init__(self, model_state: ModelState, optim_state: OptimizerState | None,
                 owner: dict):
        self.comm = model_state.comm
        self.names = model_state.names
        self.optimizer = optim_state.optimizer if optim_state is not None else None
        self._model, self._owner = model_state, owner

    def writes(self, name: str) -> bool:
        return self._model.writes(name, self._owner)


@torch.no_grad()
def part_ranges(model_state: ModelState, optim_state: OptimizerState | None,
                owner: dict) -> tuple[list[Range], list[tuple[tuple, object]], dict[str, str]]:
    """This rank's ranges of every part's tensors (under their full names, `<part>/<key>`), the
    small values to keep ((where in the small state, what)), and the parts' tensors that have a
    model tensor's shape (name -> that tensor's name). Every rank calls every part in the same
    order: a part's state may be a collective."""
    saving = _Saving(model_state, optim_state, owner)
    ranges, small, like = [], [], {}
    for part in model_state.parts:
        saved = part.state(saving)
        prefix = f"{part.name}/"
        for r in saved.ranges:
            ranges.append(Range(prefix + r.name, r.start, r.end, r.values))
            if r.like is not None:
                like[prefix + r.name] = r.like
        if saved.small is not None:
            small.append((part.small_at, saved.small))
    return ranges, small, like


def keep_small(small: dict, at: tuple, value) -> None:
    """Put a copy of `value` at the path of keys `at` in the small state `small`."""
    for key in at[:-1]:
        small = small.setdefault(key, {})
    small[at[-1]] = copy.deepcopy(value)


def _small_at(small: dict, at: tuple):
    for key in at:
        if not isinstance(small, dict) or key not in small:
            return None
        small = small[key]
    return small


class _Loading:
    """engine/part.py's `Loading`: what a load tells a part (or a kind of part the model does
    not have) of the checkpoint, read under the part's name."""

    def __init__(self, kind, model_state: ModelState, optim_state: OptimizerState | None,
                 reader, manifest: dict, small: dict, loaded: set[str]):
        self.comm = model_state.comm
        self.names = model_state.names
        self.optimizer = optim_state.optimizer if optim_state is not None else None
        self.prepared = model_state.prepared is not None
        self.loaded = loaded
        self.world_size = int(manifest["world_size"])
        self.small = _small_at(small, kind.small_at)
        self._prefix = f"{kind.name}/"
        self._reader = reader

    def keys(self) -> list[str]:
        n = len(self._prefix)
        return [k[n:] for k in self._reader.tensors if k.startswith(self._prefix)]

    def numel(self, key: str) -> int:
        return self._reader.numel(self._prefix + key)

    def read(self, key: str, start: int, end: int) -> torch.Tensor:
        return self._reader.read(self._prefix + key, start, end)

    def read_into(self, key: str, start: int, end: int, out: torch.Tensor) -> None:
        self._reader.read_into(self._prefix + key, start, end, out)

    def warn(self, message: str) -> None:
        """Warn at the first caller outside phalanx: the line that called px.load."""
        level, frame = 2, sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
            level, frame = level + 1, frame.f_back
        warnings.warn(message, stacklevel=level)


@torch.no_grad()
def load_parts(model_state: ModelState, optim_state: OptimizerState | None, reader,
               manifest: dict, small: dict, loaded: set[str]) -> None:
    """After the model and the optimizer were loaded: every part takes its state back, and
    each kind of part the model does not have is shown what the checkpoint holds of it."""
    present = set()
    for part in model_state.parts:
        present.add(part.name)
        part.load(_Loading(part, model_state, optim_state, reader, manifest, small, loaded))
    for kind in KINDS:
        if kind.name not in present:
            kind.left_out(_Loading(kind, model_state, optim_state, reader, manifest, small,
                                   loaded))
