"""`px.prepare(..., step_in_backward=True)`: each unit is stepped as soon as its gradient is
reduced, in backward, and its gradient let go ([Note: the step in backward] in
engine/stepping.py). The weights equal the ordinary step's under every strategy and precision,
with accumulation, a scheduler and a matrix-wise optimizer; zero2/zero3 hold at most two
units' reduced gradients at any moment; a checkpoint resumes at another world size; what needs
every gradient first is refused.

Everything is float64 and compared on the same ranks, so the comparisons hold on any CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import RanksFailed, engine_of, run_ranks

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def make_model(muon: bool = False) -> nn.Module:
    torch.manual_seed(0)
    bias = not muon
    return nn.Sequential(nn.Linear(12, 32, bias=bias), nn.Tanh(), nn.Linear(32, 32, bias=bias),
                         nn.Tanh(), nn.Linear(32, 32, bias=bias), nn.Tanh(),
                         nn.Linear(32, 4, bias=bias)).double()


def make_optimizer(model, muon: bool = False):
    if muon:
        return torch.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.1)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def data(steps: int, rows: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 12, generator=g, dtype=torch.float64),
             torch.randn(rows, 4, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(strategy, in_backward, precision="fp32", accum=1, muon=False, steps=4, watch=None):
    model = make_model(muon)
    opt = make_optimizer(model, muon)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision,
                            bucket_mb=0.002, step_in_backward=in_backward)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    world, r = px.world_size(), px.rank()
    batches = data(steps * accum, 2 * world)
    for s in range(steps):
        for micro in range(accum):
            x, y = batches[s * accum + micro]
            ctx = px.no_sync(model) if micro < accum - 1 else torch.enable_grad()
            with ctx:
                F.mse_loss(model(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2]).backward()
            if watch is not None:
                watch(model, micro == accum - 1)
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _both(cases):
    return {case: _diff(train(*case[:1], False, *case[1:]), train(*case[:1], True, *case[1:]))
            for case in cases}


CASES = [(s, "fp32", accum) for s in STRATEGIES for accum in (1, 2)] + \
    [(s, "bf16", 1) for s in ("ddp", "zero2", "zero3")] + \
    [(s, "fp32", 1, True) for s in ("zero2", "zero3")]  # Muon: whole matrices on owners


# 3 ranks: slow (PHALANX_SLOW=1); 2 ranks cover every strategy and case in the suite
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_equals_the_ordinary_step(world):
    for rank, diffs in enumerate(run_ranks(_both, world, args=(CASES,), timeout=300)):
        for case, diff in diffs.items():
            assert diff == 0.0, f"{case} world {world} rank {rank}: {diff}"


def _watched(strategy):
    """After each backward that synchronises: the weights have moved already, and no unit
    keeps a reduced gradient. During it: at most two units hold one at once."""
    seen = {"most": 0, "moved": 0, "kept": 0}

    def watch(model, synced):
        engine = engine_of(model)
        if not synced:
            return
        seen["moved"] += int(engine.stepped_in_backward)
        seen["kept"] += sum(u.reduced is not None or u.grad_shard is not None
                            for u in engine.units)

    original = None

    def counting(self, unit, step_one, comm):
        held = sum(u.grad_shard is not None for u in self.units)
        seen["most"] = max(seen["most"], held)
        return original(self, unit, step_one, comm)

    from phalanx.engine import stepping
    original = stepping.Stepper.step_now
    stepping.Stepper.step_now = counting
    try:
        train(strategy, True, watch=watch, accum=2)
    finally:
        stepping.Stepper.step_now = original
    return seen


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_steps_in_backward_and_holds_a_unit_or_two(strategy):
    for seen in run_ranks(_watched, 2, args=(strategy,), timeout=120):
        assert seen["moved"] == 4      # every synchronised backward stepped
        assert seen["kept"] == 0       # and let every reduced gradient go
        assert 1 <= seen["most"] <= 2  # the unit stepping (and one reduced meanwhile)


def _save_resume(path, phase, strategy):
    model = make_model()
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=0.002,
                            step_in_backward=True)
    world, r = px.world_size(), px.rank()
    b = 6 // world
    batches = data(5, 6)
    todo = batches[:3] if phase == "save" else batches[3:]
    if phase == "load":
        px.load(path, model=model, optimizer=opt)
    for x, y in todo:
        F.mse_loss(model(x[b * r:b * (r + 1)]), y[b * r:b * (r + 1)]).backward()
        opt.step()
        opt.zero_grad()
    if phase == "save":
        px.save(path, model=model, optimizer=opt)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resumes_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_resume, 2, args=(path, "save", "zero2"), timeout=120)
    got = run_ranks(_save_resume, 3, args=(path, "load", "zero3"), timeout=120)
    model = make_model()
    opt = make_optimizer(model)
    for x, y in data(5, 6):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.detach() for k, v in model.state_dict().items()}
    for weights in got:
        assert _diff(weights, want) < 1e-12


def _nan_on_rank_1(strategy):
    model = make_model()
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=0.002,
                            step_in_backward=True, on_nonfinite="skip")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = data(1, 2)[0]
    if px.rank() == 1:
        x = x * float("nan")
    with warnings.catch_warnings():  # the skip's warning (faults/nonfinite.py)
        warnings.simplefilter("ignore")
        F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = data(1, 2)[0]
    F.mse_loss(model(x), y).backward()  # and the next step steps
    opt.step()
    return _diff(before, after), _diff(after, model.state_dict())


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_skipped_step_steps_no_unit(strategy):
    for skipped, next_step in run_ranks(_nan_on_rank_1, 2, args=(strategy,), timeout=120):
        assert skipped == 0.0
        assert next_step > 0.0


def _clip():
    model = make_model()
    model, opt = px.prepare(model, make_optimizer(model), strategy="zero2",
                            step_in_backward=True)
    x, y = data(1, 2)[0]
    F.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_a_global_clip_is_refused_on_every_rank():
    with pytest.raises(RanksFailed) as caught:
        run_ranks(_clip, 2, timeout=60)
    assert "2 of 2 ranks failed" in str(caught.value)
    assert "clip_grad_norm_ with step_in_backward=True" in str(caught.value)


@pytest.mark.one_process
@pytest.mark.parametrize("options,words", [
    ({"precision": "fp16"}, "precision='fp16' decides whether a step runs"),
    ({"staleness": 1}, "staleness=1 applies each step's gradient a step later"),
    ({"offload": "optimizer", "strategy": "zero2"}, "offload='optimizer' steps on the host"),
    ({"step_in_backward": "yes"}, "step_in_backward='yes': True"),
])
def test_what_needs_every_gradient_first_is_refused(options, words):
    from phalanx.model.spec import Spec
    options = {"step_in_backward": True, **options}
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Spec.of(**options)
