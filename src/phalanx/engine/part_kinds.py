"""Every kind of part (part.py), for a load to hand what a checkpoint holds of a kind the
loading model has no part of to that kind's `left_out` (see [Note: a part in a checkpoint]).

A new kind is one line here; without it, its state in a checkpoint loaded into a model
without it is left out without a word.
"""

from __future__ import annotations

from .delayed import DelayedGrads
from .diloco import OuterSync
from .powersgd import PowerSGDReducer

__all__ = ["KINDS"]

KINDS = (PowerSGDReducer, DelayedGrads, OuterSync)  # the order of a load's word on those absent
