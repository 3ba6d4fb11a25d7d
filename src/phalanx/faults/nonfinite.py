"""Divergence caught at the step it happens: a non-finite loss on any rank, named.

A NaN or inf in one rank's loss reaches every rank through the averaged gradients and turns
every replica's parameters into NaN at the next `optimizer.step()`, silently. Here each
floating output of the prepared model checks the gradient it receives in backward (the
gradient of the loss with respect to that output, before any loss scaling): one sum over the
output, a cost in proportion to the output and not to the model (the layer that made the
output did far more work). The rank's flag rides in the same all-reduce as the gradient
buckets (one more element next to the used-parameter flags of buckets.py), so every rank
learns at the end of backward, with no extra collective, whether any rank's loss was
non-finite. Only then do the ranks exchange their flags (one small all-gather) to name the
ranks it came from. The same slot carries the step vote of engine/vote.py (a rank whose step
raised), which comes first: such a step is dropped whatever the losses were.

What follows is `px.prepare(on_nonfinite=...)`:
  "raise" (default)  drop this step's gradients and raise `NonFiniteError` from backward on
                     every rank, naming the ranks and the step;
  "skip"             drop this step's gradients (the next `optimizer.step()` changes nothing),
                     warn on rank 0 and train on;
  "warn"             warn on rank 0 and keep the gradients (the update will hold NaN);
  None               no check at all.

What it does not see: a non-finite value made inside backward from finite outputs (an
overflow in one layer's gradient). fp16's loss scaler catches those (it checks every reduced
gradient), as does `px.clip_grad_norm_`, whose returned norm is then non-finite.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["NonFiniteError", "NonFiniteWatch", "MODES"]

MODES = ("raise", "skip", "warn", None)


class NonFiniteError(FloatingPointError):
    """A rank's loss (the gradient at a model output) was NaN or infinite."""

    # every rank raises it, from the same agreed flags, and the step was dropped everywhere
    # (engine/vote.py: a loop that catches it may go on)
    raised_on_every_rank = True


class NonFiniteWatch:
    def __init__(self, mode: str, comm):
        self.mode = mode
        self.comm = comm
        self.local: torch.Tensor | None = None  # this rank's flag since the last decision

    def note(self, grad: torch.Tensor) -> None:
        """From an output's gate in backward: is the gradient arriving there finite?"""
        bad = ~torch.isfinite(grad.detach().sum())
        self.local = bad if self.local is None else self.local | bad

    def signal(self) -> float | torch.Tensor:
        """The value this rank puts in each bucket's slot (1: non-finite)."""
        return 0.0 if self.local is None else self.local

    def after_backward(self, any_rank: bool, mine: bool, step: int) -> str | None:
        """Decide at the end of a backward that communicated, from what the engine read in
        its one read of the step (engine/flat_engine.py): `any_rank`, whether any rank flagged
        (from the reduced slots; this rank's own flag in a world of one), and `mine`, this
        rank's flag. Returns "drop" when the step's gradients must be dropped; raises under
        "raise"."""
        self.local = None
        if not any_rank:
            return None
        flags = self.comm.all_gather_object(mine, tag="nonfinite:ranks") \
            if self.comm.world > 1 else [mine]
        ranks = [r for r, flag in enumerate(flags) if flag]
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        message = (f"non-finite loss at step {step}: the gradient reaching the model's outputs "
                   f"is NaN or infinite on {who}")
        if self.mode == "raise":
            raise NonFiniteError(
                message + "; this step's gradients were dropped, so the parameters are still "
                "finite. Look at that rank's batch and loss (log(0), a division by zero, a "
                "learning rate that diverged); px.prepare(on_nonfinite='skip') skips such steps "
                "and trains on")
        if self.comm.rank == 0:
            what = "the step is skipped" if self.mode == "skip" else \
                "the update goes on (on_nonfinite='warn'), so the parameters may become NaN"
            warnings.warn(f"{message}; {what}", RuntimeWarning, stacklevel=2)
        return "drop" if self.mode == "skip" else None
