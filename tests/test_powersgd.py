"""PowerSGD (px.PowerSGD, engine/powersgd.py) on real ranks (gloo), in float64.

What is pinned: at full rank it is uncompressed averaging; before start_step it is the
uncompressed path bit for bit; ddp, zero1 and zero2 at 3 ranks and one process on the global
batch give the same run (the state depends only on means over ranks); error feedback makes the
applied updates add up to the true gradients; a checkpoint resumes at another world size and
strategy as the uninterrupted run goes on; bad requests fail on every rank; the step report
counts the bytes sent and the compression.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import engine_of, run_ranks
from checkpoint_runs import K, make_batch, make_model, make_optimizer, state_of, train_steps

DTYPE = torch.float64
ROWS = 12  # the global batch: divides by 1, 2 and 3 ranks


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4)).to(DTYPE)


def _train(strategy, compression, steps, bucket_mb=0.004):
    """Parameters after each step and the step reports, on this rank's rows of each batch."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=bucket_mb,
                            compression=compression)
    rows = ROWS // px.world_size()
    mine = slice(px.rank() * rows, (px.rank() + 1) * rows)
    params, reports = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(ROWS, 16, generator=g, dtype=DTYPE), torch.randn(ROWS, 4, generator=g,
                                                                            dtype=DTYPE)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in px.unwrap(model).parameters()])
        reports.append(px.step_stats(model))
    return params, reports


def _rel(got, want) -> float:
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))


# -- bad requests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"rank": 0}, "rank of the factors"), ({"rank": 2.0}, "rank of the factors"),
    ({"start_step": -1}, "start_step"), ({"start_step": True}, "start_step"),
    ({"min_compression": -1.0}, "min_compression"),
    ({"min_compression": float("nan")}, "min_compression"),
    ({"error_feedback": 1}, "error_feedback"), ({"warm_start": "yes"}, "warm_start")])
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        px.PowerSGD(**kwargs)


def _refusals():
    out = []
    for kwargs in ({"strategy": "zero3"}, {"strategy": "fsdp"},
                   {"strategy": "ddp", "comm_dtype": torch.bfloat16},
                   {"strategy": "zero2", "precision": "fp16"}):
        try:
            px.prepare(_mlp(), None, compression=px.PowerSGD(), **kwargs)
        except ValueError as exc:
            out.append(str(exc))
    try:
        px.prepare(_mlp(), None, compression="powersgd")
    except TypeError as exc:
        out.append(str(exc))
    return out


def test_zero3_and_what_does_not_combine_are_refused_on_every_rank():
    for messages in run_ranks(_refusals, 2, timeout=60):
        assert len(messages) == 5, messages
        assert "zero3" in messages[0] and "strategy='zero2'" in messages[0]
        assert messages[1] == messages[0]  # fsdp is zero3
        assert "comm_dtype" in messages[2] and "Pass one of them" in messages[2]
        assert "fp16" in messages[3] and "bf16" in messages[3]
        assert "px.PowerSGD(" in messages[4]


# -- full rank, before start_step -------------------------------------------------------------------
def _full_rank_and_start():
    out = {}
    for strategy in ("ddp", "zero2"):
        out[strategy, "none"] = _train(strategy, None, 4)
        full = px.PowerSGD(rank=64, start_step=0, min_compression=0)  # every matrix, full rank
        out[strategy, "full"] = _train(strategy, full, 4)
        out[strategy, "late"] = _train(strategy, px.PowerSGD(rank=2, start_step=3), 4)
    return out


def test_full_rank_is_uncompressed_averaging_and_before_start_step_nothing_changes():
    for rank, out in enumerate(run_ranks(_full_rank_and_start, 2, timeout=120)):
        for strategy in ("ddp", "zero2"):
            none, _ = out[strategy, "none"]
            full, full_reports = out[strategy, "full"]
            context = f"{strategy} rank {rank}"
            # the factors were sent (at full rank they are larger than the gradients)...
            assert all(r["powersgd/compression"] < 1.0 for r in full_reports), context
            # ...and P Q^T is the mean gradient, to round-off
            assert _rel(full[-1], none[-1]) < 1e-12, context
            late, late_reports = out[strategy, "late"]
            for step in range(3):
                assert all(torch.equal(a, b) for a, b in zip(late[step], none[step])), (
                    f"{context} step {step}")
                assert late_reports[step]["powersgd/compression"] == 1.0
            assert _rel(late[3], none[3]) > 1e-4, f"{context}: step 3 was not compressed"
            assert late_reports[3]["powersgd/compression"] > 2.0


# -- strategies and world sizes -----------------------------------------------------------------
CONFIGS = {"warm": px.PowerSGD(rank=2, start_step=1),
           "cold": px.PowerSGD(rank=1, start_step=0, warm_start=False),
           "no feedback": px.PowerSGD(rank=2, start_step=1, error_feedback=False)}


def _every_strategy(strategies):
    out = {(s, c): _train(s, config, 5)[0][-1] for s in strategies
           for c, config in CONFIGS.items()}
    if px.world_size() == 1:
        out["uncompressed"] = _train("ddp", None, 5)[0][-1]
    return out


def test_ddp_zero1_zero2_at_3_ranks_equal_one_process_on_the_global_batch():
    (alone,) = run_ranks(_every_strategy, 1, args=(["ddp"],), timeout=60)
    for config in CONFIGS:  # the comparison can fail: compression changed the run
        assert _rel(alone["ddp", config], alone["uncompressed"]) > 1e-3, config
    results = run_ranks(_every_strategy, 3, args=(["ddp", "zero1", "zero2"],), timeout=120)
    for rank, got in enumerate(results):
        for (strategy, config), params in got.items():
            assert _rel(params, alone["ddp", config]) < 1e-12, (strategy, config, rank)
