"""A NaN loss on one rank is caught at the end of that backward, on every rank, and named.

Two ranks each train on their half of a batch; at step 2 rank 1's batch holds a NaN. The
reference is one process on the whole batch, in float64, that leaves step 2 out.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import phalanx as px
from phalanx.testing import run_ranks

STEPS, BAD_STEP, BAD_RANK = 4, 2, 1


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def batches(world):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4 * world, 8, generator=g, dtype=torch.float64) for _ in range(STEPS)]


def train(mode, strategy, world=2):
    px.init()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = px.prepare(model, opt, strategy=strategy, on_nonfinite=mode)
    seen = []
    for step, batch in enumerate(batches(world)):
        x = batch.chunk(world)[px.rank()].clone()
        if step == BAD_STEP and px.rank() == BAD_RANK % world:
            x[0, 0] = float("nan")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model(x).square().mean().backward()
            seen.append([str(w.message) for w in caught if "non-finite" in str(w.message)])
        except px.NonFiniteError as exc:
            seen.append(f"raised: {exc}")
        opt.step()
        opt.zero_grad()
    # the state_dict, not the parameters: under zero3 they hold values only while they compute
    return seen, [v.detach().clone() for k, v in model.state_dict().items()]


def reference(world=2):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, batch in enumerate(batches(world)):
        model(batch).square().mean().backward()
        if step != BAD_STEP:
            opt.step()
        opt.zero_grad()
    return list(model.parameters())


@pytest.mark.parametrize("mode,strategy", [("raise", "ddp"), ("raise", "zero2"),
                                           ("skip", "zero1"), ("raise", "zero3"),
                                           ("skip", "zero3")])
def test_the_rank_and_step_are_named_and_the_step_is_dropped(mode, strategy):
    results = run_ranks(train, 2, args=(mode, strategy), timeout=90)
    expected = reference()
    for rank, (seen, params) in enumerate(results):
        others = [s for i, s in enumerate(seen) if i != BAD_STEP]
        assert others == [[]] * (STEPS - 1), seen
        if mode == "raise":  # on every rank, from backward
            assert seen[BAD_STEP].startswith(
                f"raised: non-finite loss at step {BAD_STEP}: the gradient reaching the model's "
                f"outputs is NaN or infinite on rank {BAD_RANK}; this step's gradients were "
                "dropped"), seen
        else:  # a warning on rank 0 only
            assert seen[BAD_STEP] == ([f"non-finite loss at step {BAD_STEP}: the gradient "
                                       "reaching the model's outputs is NaN or infinite on "
                                       f"rank {BAD_RANK}; the step is skipped"]
                                      if rank == 0 else []), seen
        # the update of the bad step never happened: the same parameters as one process that
        # left that step out (float64; only the order of the additions differs)
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)


def test_warn_only_warns_and_the_nan_spreads_to_every_rank():
    results = run_ranks(train, 2, args=("warn", "ddp"), timeout=90)
    seen0 = results[0][0]
    assert seen0[BAD_STEP] == [f"non-finite loss at step {BAD_STEP}: the gradient reaching the "
                               f"model's outputs is NaN or infinite on rank {BAD_RANK}; the "
                               "update goes on (on_nonfinite='warn'), so the parameters may "
                               "become NaN"]
    for _, params in results:  # what the check exists to prevent
        assert any(torch.isnan(p).any() for p in params)


def test_a_world_of_one_raises_too():
    seen, params = run_ranks(train, 1, args=("raise", "ddp", 1), timeout=60)[0]
    assert seen[BAD_STEP].startswith(f"raised: non-finite loss at step {BAD_STEP}"), seen
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.one_process
def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="on_nonfinite='stop': one of 'raise'"):
        px.prepare(make_model(), on_nonfinite="stop")
