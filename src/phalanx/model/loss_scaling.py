"""Dynamic loss scaling for fp16, and the gate every output of a prepared model passes.

fp16 gradients underflow unless the loss is multiplied by a large factor before backward. The
user's loop stays `loss.backward()`: instead of scaling the loss, each floating output of the
prepared model is returned through `OutputGate`, an autograd function that is the identity in
forward and multiplies the incoming gradient by the scale in backward.

[Note: scaled exactly once]
The gate is a node of its own on each returned output, not a hook on the output tensor. A hook
on a tensor the model also used inside forward (logits returned together with a loss computed
from them) would see the loss's gradient after it was already scaled at the loss, and scale it
again. Every path from the user's loss back into the model crosses exactly one gate, the one of
the output the user took, so every gradient inside the model is scaled exactly once, as if the
loss had been. The reduced gradients are unscaled once, when the step makes their fp32 copies.
The same gate tells the engine that backward started (see [Note: the end of the outermost
backward] in engine/reducer.py), under every precision.

A consequence to know: a loss term that does not flow through the model's returned outputs
(a penalty on the parameters computed outside forward, an auxiliary loss kept on a module
attribute) is not scaled, and so ends up divided by the scale. Under fp16, return every term
that should train the model from forward, or use bf16, which needs no scaling.

The scale follows the usual schedule: halve it and skip the step when any rank saw an inf or
NaN (one MAX all-reduce, so every rank skips the same steps), double it after `growth_interval`
good steps in a row.
"""

from __future__ import annotations

import torch

from .. import host

__all__ = ["DynamicLossScaler", "OutputGate"]


class OutputGate(torch.autograd.Function):
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
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

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
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
