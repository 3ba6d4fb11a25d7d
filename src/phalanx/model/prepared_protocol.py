"""What the rest of phalanx uses of a prepared model, written down as the engine's is
(engine/__init__.py's `Engine`): checkpoints (checkpoint/) read it, and continue mode's
relayout (relayout.py) builds its engine again.

The fields are `PreparedModule`'s (prepared.py). Most carry a leading underscore for the
user's sake, not phalanx's: a prepared model answers the attributes it lacks with the user's
module's (`model.config`, `model.generate`), so a public `engine` or `comm` of its own would
hide the user's attributes of that name. This protocol is the list of them other modules may
use; tests/test_part_walk.py checks that a prepared model of every kind has them all.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..engine import Engine

__all__ = ["Prepared"]


class Prepared(Protocol):
    """A prepared model as checkpoint/ and relayout.py use it."""

    module: torch.nn.Module  # the user's module (a compiled one, if compiled before prepare)
    loss_scaler: object      # fp16's DynamicLossScaler (a Stateful), else None
    _engine: Engine          # the engine behind it; relayout.py puts a new one in its place
    _comm: object            # the job's Comm (also where the engine's is a world of one: DiLoCo)
    _precision: object       # the Precision (precision.py); a manifest records its `name`
    _original_dtypes: dict   # name -> the dtype the tensor had before prepare cast it
    # continue mode's relayout (relayout.py)
    _optimizer: object       # a weak reference to the optimizer prepared with it, or None
    _build: object           # what builds its engine again for another layout (prepare.py)
    _clock: object           # the step report's StepClock (observe/step_report.py), or None

    def _parts(self) -> list:
        """The features beside the strategy that keep state: the engine's parts, then
        DiLoCo's outer step (engine/part.py)."""

    def _use_engine(self, engine) -> None:
        """Run on `engine` from now on (relayout.py)."""

