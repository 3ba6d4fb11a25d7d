"""precision="bf16-true": bf16 weights, gradients and optimizer state, and updates that do not
vanish.

[Note: bf16-true's step]
Under "bf16-true" there is no fp32 master: the parameters are their own masters, in bf16, and
the optimizer state is kept in bf16 too (4 bytes per parameter for AdamW's two moments where
mixed precision keeps 8, and no 4-byte master). Stepped in bf16 as it is, an update smaller
than half a unit in the last place of the weight (2^-9 of it) rounds away: with a learning rate
of 1e-4 most of AdamW's updates to a weight of magnitude 1 are lost, and training stalls.

So the optimizer steps in fp32, a run of units at a time (engine/stepping.py): for the call,
each tensor it steps and its per-element state are upcast (temporaries the size of the run),
it steps them, and they go back to bf16: the state to the nearest bf16, the weights by
*stochastic rounding*: up or down with the probabilities that make the rounding exact in
expectation (x in [a, b) rounds to b with probability (x - a) / (b - a)), so an update of a
tenth of a unit in the last place moves the weight by a whole unit one time in ten, and on
average by the update. The random bits come from a hash of (the element's index in its
parameter, the parameter's position in the optimizer, the step), not from a generator's
state, so every rank, under every strategy and world size, rounds an element alike, and a
sharded run equals a replicated one bit for bit.

The alternative kept as a measured option is a compensation buffer (Kahan summation: a bf16
buffer per weight holding what the last rounding lost, added back before the next step), exact
without randomness but 2 more bytes per parameter, kept across steps (and in checkpoints).
Measured (benchmarks/bf16_true.py, a small LM, 500 steps): see docs/guides/precision.md; the
stochastic rounding reached bf16 mixed precision's loss within the target with no extra memory,
so it is the one px.prepare uses.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["stochastic_round", "fp32_step", "ROUNDINGS", "Compensation"]

ROUNDINGS = ("stochastic", "nearest", "kahan")

def _signed(value: int) -> int:
    """`value` modulo 2^64, as the signed 64-bit integer with those bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_M1 = _signed(0xBF58476D1CE4E5B9)  # splitmix64's multipliers
_M2 = _signed(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15


def _bits(index: torch.Tensor, salt: int) -> torch.Tensor:
    """16 random bits per element of `index` (int64), a function of (index, salt) alone:
    splitmix64's finaliser over index + salt * golden ratio (arithmetic wraps in int64)."""
    z = index + _signed(salt * _GOLDEN)
    z = (z ^ (z >> 30)) * _M1
    z = (z ^ (z >> 27)) * _M2
    z = z ^ (z >> 31)
    return z & 0xFFFF


def stochastic_round(x: torch.Tensor, start: int, salt: int) -> torch.Tensor:
    """`x` (fp32, flattened elements start, start+1, ... of a parameter) rounded to bf16
    stochastically (see the Note), with the bits of `_bits(element index, salt)`."""
    index = torch.arange(start, start + x.numel(), dtype=torch.int64, device=x.device)
    raw = x.detach().reshape(-1).contiguous().view(torch.int32).to(torch.int64)
    raw = (raw + _bits(index, salt)) & ~0xFFFF  # add below the kept bits, then drop them
    finite = torch.isfinite(x.reshape(-1))
    rounded = raw.to(torch.int32).view(torch.float32)
    rounded = torch.where(finite, rounded, x.reshape(-1))
    return rounded.to(torch.bfloat16).view(x.shape)  # exact: the low 16 bits are zero


def _plain_state(value) -> bool:
    """A per-element state tensor kept in bf16 between steps: a plain floating tensor (a
    quantized one, torchao's low-bit state, keeps its own form and computes in fp32 itself)."""
    return type(value) is torch.Tensor and value.is_floating_point() and value.dim() > 0


def _salt(position: int, step: int) -> int:
    return (position * 1_000_003 + step) & 0x7FFFFFFF


class Compensation:
    """The Kahan option: what the last rounding of each weight lost, in bf16, by tensor."""

    def __init__(self):
        self.lost: dict[int, torch.Tensor] = {}


@contextmanager
def fp32_step(holders, optimizer, position_of: dict, step: int, rounding: str = "stochastic",
              compensation: Compensation | None = None):
    """Around one call of the optimizer's step (see the Note): `holders` (optim.py's Held)
    with a gradient are upcast with their state, and rounded back after."""
    active = [h for h in holders if h.tensor.grad is not None]
    kept = []
    for h in active:
        t = h.tensor
        bf16, grad = t.data, t.grad
        full = bf16.float()
        if compensation is not None and id(t) in compensation.lost:
            full += compensation.lost[id(t)].float()
        t.data, t.grad = full, grad.float()
        state = optimizer.state.get(t)
        if state:
            for key, value in state.items():
                if _plain_state(value):
                    state[key] = value.float()
        kept.append((h, bf16, grad))
    try:
        yield
    finally:
        for h, bf16, grad in kept:
            t = h.tensor
            full = t.data
            if rounding == "stochastic":
                bf16.copy_(stochastic_round(full, h.start, _salt(position_of[id(h.param)], step)))
            else:
                bf16.copy_(full)
                if compensation is not None:
                    compensation.lost[id(t)] = (full - bf16.float()).to(torch.bfloat16)
            t.data, t.grad = bf16, grad
            state = optimizer.state.get(t)
            if state:
                for key, value in state.items():
                    if _plain_state(value):
                        state[key] = value.to(torch.bfloat16)
