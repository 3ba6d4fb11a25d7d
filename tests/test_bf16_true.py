"""precision="bf16-true": bf16 weights, gradients and optimizer state with no fp32 master, the
step in fp32 rounded back stochastically ([Note: bf16-true's step] in engine/rounding.py).

The rounding is a function of (element, parameter, step) alone, so every strategy, with or
without the step in backward, ends bit for bit where ddp ends; it is unbiased; and it keeps the
updates that rounding to nearest throws away. A checkpoint resumes at another world size.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.engine.rounding import stochastic_round
from phalanx.testing import engine_of, run_ranks


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def batches(steps: int, rows: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 12, generator=g), torch.randn(rows, 4, generator=g))
            for _ in range(steps)]


def train(strategy, in_backward=False, steps=6):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, opt = px.prepare(model, opt, strategy=strategy, precision="bf16-true",
                            bucket_mb=0.001, step_in_backward=in_backward)
    world, r = px.world_size(), px.rank()
    for x, y in batches(steps, 2 * world):
        F.mse_loss(model(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2]).backward()
        opt.step()
        opt.zero_grad()
    held = {str(t.dtype) for t in px.unwrap(model).parameters()}
    state = {str(v.dtype) for s in opt.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0}
    masters = [u for u in engine_of(model).units if u.master.dtype != torch.bfloat16]
    return {k: v.clone() for k, v in model.state_dict().items()}, held, state, len(masters)


def _every_strategy():
    return {(s, b): train(s, b) for s in ("ddp", "zero1", "zero2", "zero3")
            for b in (False, True)}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_strategy_ends_where_ddp_ends_in_bf16(world):
    for rank, got in enumerate(run_ranks(_every_strategy, world, timeout=180)):
        want = got["ddp", False][0]
        moved = max((want[k] - make_model().state_dict()[k]).abs().max().item() for k in want)
        assert moved > 0
        for case, (weights, held, state, masters) in got.items():
            assert held == {"torch.bfloat16"}, case      # the weights are bf16
            assert state == {"torch.bfloat16"}, case     # and so is AdamW's state
            assert masters == 0, case                    # no fp32 master anywhere
            for k in want:
                assert torch.equal(weights[k], want[k]), f"{case} world {world} rank {rank} {k}"


@pytest.mark.one_process
def test_stochastic_rounding_is_unbiased_and_deterministic():
    a = torch.tensor(1.0, dtype=torch.bfloat16).float()
    ulp = 2.0 ** -7  # of bf16 at 1.0
    x = torch.full((200_000,), a.item() + 0.3 * ulp)
    rounded = stochastic_round(x, 0, salt=5).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + ulp}  # one of the two neighbours
    up = (rounded > 1.0).float().mean().item()
    assert abs(up - 0.3) < 0.01                               # as often as the remainder says
    assert torch.equal(stochastic_round(x, 0, salt=5), stochastic_round(x, 0, salt=5))
    assert not torch.equal(stochastic_round(x, 0, salt=5), stochastic_round(x, 0, salt=6))
    # a slice rounds as the same elements of the whole do (any sharding rounds alike)
    assert torch.equal(stochastic_round(x[1000:3000], 1000, salt=5),
                       stochastic_round(x, 0, salt=5)[1000:3000])
    exact = torch.tensor([1.0, -2.0, float("inf"), 0.0])
    assert torch.equal(stochastic_round(exact, 0, 1).float(), exact)  # bf16 values stay


def _small_updates(rounding):
    """SGD with updates of a fifth of bf16's unit in the last place at the weights' size."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2 * 2.0 ** -7)
    model, opt = px.prepare(model, opt, precision="bf16-true")
    engine_of(model).optim.round_by(rounding)
    for _ in range(50):
        model.weight.grad = None
        (-model(torch.ones(1, 64)).sum()).backward()  # every weight's gradient: -1
        opt.step()
        opt.zero_grad()
    return px.unwrap(model).weight.float().mean().item()


@pytest.mark.one_process
def test_updates_below_the_last_place_are_kept_on_average():
    # 50 steps of +0.2 ulp each: 10 ulps in exact arithmetic (1 + 10 * 2^-7 = 1.078)
    px.init()
    nearest = _small_updates("nearest")
    stochastic = _small_updates("stochastic")
    assert nearest == 1.0  # every update rounded away
    assert abs(stochastic - (1 + 10 * 2.0 ** -7)) < 2 * 2.0 ** -7


def _save_resume(path, phase, strategy):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = px.prepare(model, opt, strategy=strategy, precision="bf16-true",
                            bucket_mb=0.001)
    if phase == "load":
        px.load(path, model=model, optimizer=opt)
    else:
        for x, y in batches(2, 6):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        px.save(path, model=model, optimizer=opt)
    state = {str(v.dtype) for s in opt.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0}
    return {k: v.clone() for k, v in model.state_dict().items()}, px.optimizer_state_dict(opt), \
        state


def test_a_checkpoint_resumes_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_resume, 2, args=(path, "save", "zero2"), timeout=120)[0]
    for weights, optimizer, state in run_ranks(_save_resume, 3, args=(path, "load", "zero3"),
                                               timeout=120):
        assert state == {"torch.bfloat16"}
        for k in weights:
            assert torch.equal(weights[k], saved[0][k])
        for index, entry in saved[1]["state"].items():
            for key, value in entry.items():
                assert torch.equal(optimizer["state"][index][key], value), (index, key)


def _capped(strategy):
    """Pieces cut at 96 elements (flat.py's cap, set low): several pieces a parameter."""
    from phalanx.engine import flat
    flat.PIECE_CAP = 96
    return train(strategy)


def test_pieces_cut_at_the_cap_round_and_step_alike():
    """bf16-true with every parameter cut into pieces of at most 96 elements, each stepped in
    its own fp32 batch: the weights end where the uncut run ends, bit for bit (the rounding's
    bits hang on the element, not the piece)."""
    for strategy in ("zero2", "zero3"):
        cut = run_ranks(_capped, 2, args=(strategy,), timeout=120)
        whole = run_ranks(train, 2, args=(strategy,), timeout=120)
        for (a, *_), (b, *_) in zip(cut, whole):
            for k in b:
                assert torch.equal(a[k], b[k]), (strategy, k)
