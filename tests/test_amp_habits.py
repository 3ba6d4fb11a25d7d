"""A loop written for torch DDP's AMP (the script's own `torch.autocast` and
`torch.amp.GradScaler`, `scaler.unscale_` then torch's `clip_grad_norm_`) on a model prepared
with precision="fp32", under ddp, zero1, zero2 and zero3, against torch DDP's own run of the
same loop in the same job: the same steps skipped (the same scale after every step), the same
clipped norms, and parameters within AMP's noise.

Steps are skipped two ways: the first steps' scale is too large for fp16 (the gradient reaching
the model's fp16 outputs overflows), and at step INJECT one element of the last parameter's
gradient is made infinite, an element that under sharded gradients only one rank holds, so the
ranks must agree on the finding. See [Note: torch.amp's GradScaler on a prepared model] in
engine/amp.py.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from small_mlp import ROWS, batch, rank_rows, rel_err
from torch.nn.parallel import DistributedDataParallel

import phalanx as px
from phalanx.testing import run_ranks

WORLD, STEPS, INJECT = 2, 9, 6
STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 3))


def _amp_loop(model, opt, last):
    """The script: returns the scale after each step, the clipped norms, the parameters."""
    step = [0]

    def inject(grad):  # one element, at one step
        if step[0] != INJECT:
            return grad
        grad = grad.clone()
        grad.view(-1)[-1] = float("inf")
        return grad

    last.register_hook(inject)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**19, growth_interval=2)
    scales, norms = [], []
    for step[0] in range(STEPS):
        x, y = rank_rows(*batch(step[0], ROWS * WORLD))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, norms


def _params(module):
    return [p.detach().double().clone() for p in module.state_dict().values()]


def _jobs():
    px.init()
    out = {}
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out["torch"] = (*_amp_loop(model, opt, list(model.parameters())[-1]), _params(model.module))
    for strategy in STRATEGIES:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        last = list(model.parameters())[-1]
        model, opt = px.prepare(model, opt, strategy=strategy)
        out[strategy] = (*_amp_loop(model, opt, last), _params(model))
    # precision="fp16" scales the loss itself: a GradScaler on top is refused by name
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy="zero2", precision="fp16")
    scaler = torch.amp.GradScaler("cpu")
    x, y = rank_rows(*batch(0, ROWS * WORLD))
    scaler.scale(F.mse_loss(model(x), y)).backward()
    try:
        scaler.unscale_(opt)
        out["fp16"] = None
    except ValueError as exc:
        out["fp16"] = str(exc)
    px.shutdown()
    return out


def test_autocast_and_grad_scaler_skip_the_steps_torch_ddp_skips():
    for rank, out in enumerate(run_ranks(_jobs, WORLD, timeout=90)):
        want_scales, want_norms, want_params = out["torch"]
        skipped = sum(b < a for a, b in zip([2.0**19] + want_scales, want_scales))
        assert skipped >= 2 and want_scales[INJECT] < want_scales[INJECT - 1]  # both kinds
        assert want_scales[-1] > min(want_scales)  # and the scale grew again
        for strategy in STRATEGIES:
            scales, norms, params = out[strategy]
            where = f"{strategy}, rank {rank}"
            assert scales == want_scales, where
            assert [math.isfinite(n) for n in norms] == \
                [math.isfinite(n) for n in want_norms], where
            finite = [(a, b) for a, b in zip(norms, want_norms) if math.isfinite(b)]
            assert [a for a, _ in finite] == pytest.approx([b for _, b in finite], rel=1e-5), where
            for i, (a, b) in enumerate(zip(params, want_params)):
                assert rel_err(a, b) <= 1e-5, f"{where}: parameter {i}"
        assert "precision='fp16'" in out["fp16"]
