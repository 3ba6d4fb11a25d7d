"""Dynamic loss scaling for fp16, and the node every output of a prepared model passes.

fp16 gradients underflow unless the loss is multiplied by a large factor before backward. The
user's loop stays `loss.backward()`: instead of scaling the loss, each floating output of the
prepared model is returned through `OutputNode`, an autograd function that is the identity in
forward and multiplies the incoming gradient by the scale in backward.

[Note: scaled exactly once]
The output node is a node of its own on each returned output, not a hook on the output tensor. A
hook on a tensor the model also used inside forward (logits returned together with a loss computed
from them) would see the loss's gradient after it was already scaled at the loss, and scale it
again. Every path from the user's loss back into the model crosses exactly one output node, the one
of the output the user took, so every gradient inside the model is scaled exactly once, as if the
loss had been. The reduced gradients are unscaled once, when the step makes their fp32 copies. The
same node tells the engine that backward started (see [Note: the end of the outermost backward] in
engine/reducer.py), under every precision.

A consequence to know: a loss term that does not flow through the model's returned outputs
(a penalty on the parameters computed outside forward, an auxiliary loss kept on a module
attribute) is not scaled, and so ends up divided by the scale. Under fp16, return every term
that should train the model from forward, or use bf16, which needs no scaling.

The scale follows the usual schedule: halve it and skip the step when any rank saw an inf or
NaN (one MAX all-reduce, so every rank skips the same steps), double it after `growth_interval`
good steps in a row.

[Note: the ranks' sum must fit in fp16]
Gradients are averaged over the ranks in the dtype they travel in, fp16 unless `comm_dtype`
says otherwise, and an average is a sum before it is a mean: gloo's AVG (and SUM followed by a
division) adds the ranks' fp16 values in fp16 and divides last (measured, torch 2.13 gloo: two
ranks' 40000.0 average to inf, not 40000). With every rank's gradients multiplied by the loss
scale S, the sum over N ranks is N times the scaled mean gradient, so a mean that fits under
fp16's 65504 still overflowed: on a causal LM whose loss comes from fp32 soft-capped logits
(Gemma-2's shape) the final norm's weight gradient at S = 2**16 reached 38205 on one rank and
42496 on the other: their mean fit, their sum was inf, so 2 ranks skipped a step that
torch.amp's GradScaler on the same global batch did not (and ended 10 steps 5e-3 away from
fp32's parameters where GradScaler stayed at 1e-4; tests/test_fp16_scaling.py). PyTorch's DDP
divides each rank's gradient by the world size before it sums; here the division is folded into the
scale: `loss_scale` is the scale the schedule above moves (GradScaler's, kept in checkpoints), and
each rank's gradients are multiplied by `scale = loss_scale / D`, D the smallest power of two >= the
number of ranks whose fp16 gradients are summed (a power of two so that the scaling and the
unscaling stay exact). The sum of the ranks' gradients is then at most loss_scale times the largest
of them, and the reduced mean is the mean gradient times `scale`, which the step divides by, as
before. One process, and gradients that travel in fp32 or bf16 (`comm_dtype`), have D = 1.
"""

from __future__ import annotations

import torch

from ..comm import host

__all__ = ["DynamicLossScaler", "OutputNode"]


class OutputNode(torch.autograd.Function):
    """Identity forward; backward calls `on_grad(grad)` with the gradient that arrives (before
    any scaling) and multiplies it by `scaler.scale` if any."""

    @staticmethod
    def forward(ctx, tensor, on_grad, scaler):
        ctx.on_grad, ctx.scaler = on_grad, scaler
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        if ctx.on_grad is not None:
            ctx.on_grad(grad)
        if ctx.scaler is not None:
            grad = grad * ctx.scaler.scale
        return grad, None, None


class DynamicLossScaler:
    """fp16's dynamic loss scale. `loss_scale` follows the schedule (init 2**16, x2 after
    `growth_interval` good steps, x0.5 on an overflow, as torch.amp's GradScaler); `scale` is
    what each rank's gradients are multiplied by in backward and divided by at the step:
    `loss_scale / divisor`, where `divisor` is the smallest power of two >= `ranks`, the number of
    ranks whose fp16 gradients one reduction adds up (see [Note: the ranks' sum must fit in
    fp16])."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, ranks: int = 1):
        if ranks < 1:
            raise ValueError(f"ranks={ranks!r}: the number of ranks, at least 1")
        self.loss_scale = float(init_scale)
        self.divisor = float(1 << (int(ranks) - 1).bit_length())  # power of two >= ranks
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        """The factor every rank's gradients carry between backward and the step."""
        return self.loss_scale / self.divisor

    @scale.setter
    def scale(self, value: float) -> None:
        self.loss_scale = float(value) * self.divisor

    def found_inf(self, grads, comm) -> bool:
        """True when any rank's gradients hold an inf or NaN (agreed on by all ranks). The
        engine reads this flag with the rest of the step at the end of backward; this is for a
        step that finds none read."""
        grads = [g for g in grads if g is not None]
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads \
            else torch.ones((), dtype=torch.bool, device=comm.device)
        flag = (~finite).float().reshape(1).to(comm.device)
        comm.all_reduce(flag, op="max", tag="loss_scale:found_inf")
        return bool(host.read(flag)[0])

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.loss_scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.loss_scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        """"scale" is `loss_scale`, which does not depend on the number of ranks: a checkpoint
        resumes at another world size with the same schedule."""
        return {"scale": self.loss_scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.loss_scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
