"""The precision names: one vocabulary for `px.prepare`, `px.plan` and `phalanx plan`.

    name       forward and backward in      masters and optimizer state      loss scaling
    fp32       the parameters' own dtype    the parameters themselves        none
    bf16       bfloat16                     fp32, apart from the parameters  none
    fp16       float16                      fp32, apart from the parameters  dynamic
    bf16-true  bfloat16                     bfloat16: no master copy         none

"bf16" and "fp16" are mixed precision wherever they are written: low-precision compute and
gradients, fp32 master weights and fp32 optimizer state (Micikevicius et al. 2018,
arXiv:1710.03740), as PyTorch Lightning's "bf16-mixed" and "16-mixed" are; those spellings
("bf16-mixed", "fp16-mixed") are accepted as aliases and mean the same. "bf16-true" (Lightning's
name) keeps everything in bf16, optimizer moments included, with no master copy: the step runs
in fp32 on a run of units at a time and rounds the weights back stochastically, so small
updates are kept on average ([Note: bf16-true's step] in engine/rounding.py).

The byte sizes below are per element and assume fp32 parameters, as the planner plans them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PrecisionSpec", "PRECISIONS", "PLANNER_PRECISIONS", "PRECISION_ALIASES",
           "precision_spec"]


@dataclass(frozen=True)
class PrecisionSpec:
    """What a precision name means: the dtype forward and backward compute in, and whether
    fp32 masters and optimizer state are kept apart from the parameters."""

    name: str
    compute_dtype: torch.dtype | None   # None: each parameter's own dtype
    fp32_masters: bool                  # a separate fp32 master copy and fp32 optimizer state
    loss_scaling: bool                  # dynamic loss scaling (fp16's narrow range)
    description: str
    planner_only: bool = False          # a name px.plan knows and px.prepare does not
    rounding: str | None = None         # bf16-true: how the fp32 step rounds back (rounding.py)

    @property
    def mixed(self) -> bool:
        return self.fp32_masters

    @property
    def weight_bytes(self) -> int:
        """Bytes per parameter element the model computes with (fp32 parameters: 4)."""
        return self.compute_dtype.itemsize if self.compute_dtype is not None else 4

    @property
    def grad_bytes(self) -> int:
        """Gradients are made, reduced and kept in the compute dtype."""
        return self.weight_bytes

    @property
    def master_bytes(self) -> int:
        """The separate master copy per trainable element (0: the parameters are the master)."""
        return 4 if self.fp32_masters else 0

    @property
    def state_bytes(self) -> int:
        """Optimizer state (moments, momentum) per element: fp32 under mixed precision, else
        the parameters' own dtype."""
        return 4 if self.fp32_masters else self.weight_bytes

    @property
    def activation_bytes(self) -> int:
        return self.weight_bytes


_LOW = "weights and gradients, fp32 master weights and optimizer state"
PRECISIONS: dict[str, PrecisionSpec] = {
    "fp32": PrecisionSpec("fp32", None, False, False,
                          "fp32 weights, gradients and optimizer state"),
    "bf16": PrecisionSpec("bf16", torch.bfloat16, True, False, f"bf16 {_LOW}"),
    "fp16": PrecisionSpec("fp16", torch.float16, True, True,
                          f"fp16 {_LOW}, dynamic loss scaling"),
    "bf16-true": PrecisionSpec("bf16-true", torch.bfloat16, False, False,
                               "everything in bf16, optimizer moments included, no master "
                               "copy; stochastic rounding of each update",
                               rounding="stochastic"),
}
PLANNER_PRECISIONS: dict[str, PrecisionSpec] = dict(PRECISIONS)
PRECISION_ALIASES = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}


def precision_spec(name, *, planner: bool = False) -> PrecisionSpec:
    """The meaning of a precision name (case-insensitive, aliases resolved); ValueError naming
    the choices otherwise. `planner`: the planner's names (today the same as px.prepare's)."""
    key = name.strip().lower() if isinstance(name, str) else None
    key = PRECISION_ALIASES.get(key, key)
    known = PLANNER_PRECISIONS if planner else PRECISIONS
    if key in known:
        return known[key]
    choices = ", ".join(f"'{n}'" for n in known)
    raise ValueError(f"unknown precision {name!r}; choose one of {choices} "
                     f"('bf16-mixed' and 'fp16-mixed' are 'bf16' and 'fp16')")
