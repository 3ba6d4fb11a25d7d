"""PowerSGD (px.PowerSGD, engine/powersgd.py) on real ranks (gloo), in float64.

What is pinned: at full rank it is uncompressed averaging; before start_step it is the
uncompressed path bit for bit; ddp, zero1 and zero2 at 3 ranks and one process on the global
batch give the same run (the state depends only on means over ranks); error feedback makes the
applied updates add up to the true gradients; a checkpoint resumes at another world size and
strategy as the uninterrupted run goes on; bad requests fail on every rank; the step report
counts the bytes sent and the compression.

Every 2-rank run is made in one start of the ranks (the `at_2_ranks` fixture): starting ranks,
not training these small models, took most of this file's time.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from checkpoint_runs import K, make_model, make_optimizer, state_of, train_steps

import phalanx as px
from phalanx.testing import engine_of, run_ranks

DTYPE = torch.float64
ROWS = 12  # the global batch: divides by 1, 2 and 3 ranks


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4)).to(DTYPE)


def _train(strategy, compression, steps, bucket_mb=0.004, precision="fp32"):
    """Parameters after each step and the step reports, on this rank's rows of each batch."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=bucket_mb,
                            compression=compression, precision=precision)
    rows = ROWS // px.world_size()
    mine = slice(px.rank() * rows, (px.rank() + 1) * rows)
    params, reports = [], []
    compressor = engine_of(model).compression
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(ROWS, 16, generator=g, dtype=DTYPE), torch.randn(ROWS, 4, generator=g,
                                                                            dtype=DTYPE)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in px.unwrap(model).parameters()])
        reports.append(px.step_stats(model))
    if precision == "bf16":  # the parameters (bf16), the error feedback's dtypes, bytes sent
        return ([p.double() for p in params[-1]], [e.dtype for e in compressor.errors.values()],
                reports[-1]["powersgd/bytes"])
    return params, reports


def _rel(got, want) -> float:
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))


FEEDBACK_STEPS = (10, 40, 160)


def _at_2_ranks(path):
    """Every 2-rank run of this file in one start of the ranks (each is a function below)."""
    return {"start": _full_rank_and_start(),
            "feedback": _with_and_without_feedback(FEEDBACK_STEPS),
            "nan": _a_nan_step_skipped(1),
            "reports": _two_reports(),
            "uninterrupted": _uninterrupted_and_first_half(path)}


@pytest.fixture(scope="module")
def at_2_ranks(tmp_path_factory):
    """Each rank's results of `_at_2_ranks`, and the checkpoint it saved."""
    path = str(tmp_path_factory.mktemp("powersgd") / "ckpt")
    return run_ranks(_at_2_ranks, 2, args=(path,), timeout=180), path


# -- bad requests --------------------------------------------------------------------------------
@pytest.mark.one_process
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
                   {"strategy": "zero2", "precision": "fp16"},
                   {"strategy": "ddp", "staleness": 1}, {"strategy": "zero2", "shard_size": 1},
                   {"strategy": px.DiLoCo(sync_every=2)}):
        model = _mlp()
        try:
            px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       compression=px.PowerSGD(), **kwargs)
        except ValueError as exc:
            out.append(str(exc))
    try:
        px.prepare(_mlp(), None, compression="powersgd")
    except TypeError as exc:
        out.append(str(exc))
    return out


def test_zero3_and_what_does_not_combine_are_refused_on_every_rank():
    for messages in run_ranks(_refusals, 2, timeout=60):
        assert len(messages) == 8, messages
        assert "zero3" in messages[0] and "strategy='zero2'" in messages[0]
        assert messages[1] == messages[0]  # fsdp is zero3
        assert "comm_dtype" in messages[2] and "Pass one of them" in messages[2]
        assert "fp16" in messages[3] and "bf16" in messages[3]
        assert "staleness=1" in messages[4] and "use one of them" in messages[4]
        assert "shard_size" in messages[5] and "leave shard_size out" in messages[5]
        assert "DiLoCo" in messages[6] and "use one of them" in messages[6]
        assert "px.PowerSGD(" in messages[7]


# -- full rank, before start_step ------------------------------------------------------------------
def _full_rank_and_start():
    out = {}
    for strategy in ("ddp", "zero2"):
        out[strategy, "none"] = _train(strategy, None, 4)
        full = px.PowerSGD(rank=64, start_step=0, min_compression=0)  # every matrix, full rank
        out[strategy, "full"] = _train(strategy, full, 4)
        out[strategy, "late"] = _train(strategy, px.PowerSGD(rank=2, start_step=3), 4)
    return out


def test_full_rank_is_uncompressed_averaging_and_before_start_step_nothing_changes(at_2_ranks):
    for rank, out in enumerate(r["start"] for r in at_2_ranks[0]):
        for strategy in ("ddp", "zero2"):
            none, _ = out[strategy, "none"]
            full, full_reports = out[strategy, "full"]
            context = f"{strategy} rank {rank}"
            # the factors were sent (at full rank they are larger than the gradients)...
            assert all(r["powersgd/compression"] < 1.0 for r in full_reports), context
            # ...and P Q^T is the mean gradient, to round-off (measured: 1.7e-16)
            assert _rel(full[-1], none[-1]) < 1e-12, context
            late, late_reports = out[strategy, "late"]
            for step in range(3):
                assert all(torch.equal(a, b) for a, b in zip(late[step], none[step])), (
                    f"{context} step {step}")
                assert late_reports[step]["powersgd/compression"] == 1.0
            # measured: 1.3e-2
            assert _rel(late[3], none[3]) > 1e-4, f"{context}: step 3 was not compressed"
            assert late_reports[3]["powersgd/compression"] > 2.0


# -- strategies and world sizes ----------------------------------------------------------------
CONFIGS = {"warm": px.PowerSGD(rank=2, start_step=1),
           "cold": px.PowerSGD(rank=1, start_step=0, warm_start=False),
           "no feedback": px.PowerSGD(rank=2, start_step=1, error_feedback=False)}


def _every_strategy(strategies):
    """The warm start under every strategy; the other configurations under the last."""
    out = {(s, c): _train(s, config, 4)[0][-1] for s in strategies
           for c, config in CONFIGS.items() if c == "warm" or s == strategies[-1]}
    if px.world_size() == 1:
        out["uncompressed"] = _train("ddp", None, 4)[0][-1]
    else:  # bf16 compute: the factors and the error feedback in fp32, sent in bf16
        # (one unit each: bucket_mb caps a unit's bytes, so a smaller cap would lay them out
        # differently in two dtypes)
        out["bf16"] = _train("zero2", CONFIGS["warm"], 4, bucket_mb=25, precision="bf16")
        out["float64 bytes"] = _train("zero2", CONFIGS["warm"], 2, bucket_mb=25)[1][-1][
            "powersgd/bytes"]
    return out


def test_ddp_zero1_zero2_at_3_ranks_equal_one_process_on_the_global_batch():
    (alone,) = run_ranks(_every_strategy, 1, args=(["ddp"],), timeout=60)
    for config in CONFIGS:  # the comparison can fail: compression changed the run (measured:
        # 4.3e-2, 0.12, 5.1e-2 from the uncompressed run)
        assert _rel(alone["ddp", config], alone["uncompressed"]) > 1e-3, config
    results = run_ranks(_every_strategy, 3, args=(["ddp", "zero1", "zero2"],), timeout=120)
    for rank, got in enumerate(results):
        bf16, dtypes, sent = got.pop("bf16")
        assert dtypes and set(dtypes) == {torch.float32}
        assert sent * 4 == got.pop("float64 bytes")  # the same elements, 2 bytes each
        # it trains like the float64 run, to bf16's round-off (measured: 4.3e-2 after 4 steps)
        assert _rel(bf16, alone["ddp", "warm"]) < 0.1
        for (strategy, config), params in got.items():
            # measured: 3.1e-16 at most
            assert _rel(params, alone["ddp", config]) < 1e-12, (strategy, config, rank)


# -- error feedback --------------------------------------------------------------------------------
class _Fixed(nn.Module):
    """loss = sum(W * C_rank): the gradient is C_rank whatever W is, so every step's true mean
    gradient is the same G = mean(C), of rank 6, which PowerSGD at rank 1 cannot send at once."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(6, 8, dtype=DTYPE))

    def forward(self, c):
        return (self.weight * c).sum()


def _fixed_gradients(world):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(6, 8, generator=g, dtype=DTYPE) for _ in range(world)]


def _accumulated_updates(error_feedback, checkpoints):
    """SGD at lr 1 from W = 0: after T steps -W is the sum of the T applied updates; returns
    -W / T at each T of `checkpoints`, and -W + the mean error at the last."""
    model = _Fixed()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = px.prepare(model, opt, step_stats=False, compression=px.PowerSGD(
        rank=1, start_step=0, error_feedback=error_feedback))
    c = _fixed_gradients(px.world_size())[px.rank()]
    out = {}
    for t in range(1, max(checkpoints) + 1):
        model(c).backward()
        opt.step()
        opt.zero_grad()
        if t in checkpoints:
            out[t] = -px.unwrap(model).weight.detach().clone() / t
    engine = engine_of(model)
    errors = engine.compression.mean_errors(engine.comm)
    mean_error = next(iter(errors.values())) if errors else torch.zeros(6, 8, dtype=DTYPE)
    return out, -px.unwrap(model).weight.detach() + mean_error


def _with_and_without_feedback(steps):
    return _accumulated_updates(True, steps), _accumulated_updates(False, steps[:1])


def test_error_feedback_makes_the_applied_updates_add_up_to_the_true_gradients(at_2_ranks):
    want = torch.stack(_fixed_gradients(2)).mean(0)
    assert torch.linalg.matrix_rank(want) == 6
    (updates, total), (without, _) = at_2_ranks[0][0]["feedback"]
    gap = {t: ((u - want).norm() / want.norm()).item() for t, u in updates.items()}
    # the applied updates are exactly T*G less the mean error left over (measured: 2.8e-15
    # relative)...
    assert (total - 160 * want).abs().max() < 1e-12 * 160 * want.abs().max()
    # ...and that error stays bounded, so their mean goes to G about as 1/T (measured: 0.42,
    # 0.081, 0.021 after 10, 40, 160 steps)
    assert gap[160] < 0.05 and gap[160] < gap[40] / 2 and gap[40] < gap[10] / 2, gap
    # without error feedback it stays a rank-1 approximation of G (measured: 0.72 to 0.73
    # after 5 to 160 steps)
    assert ((without[10] - want).norm() / want.norm()).item() > 0.5


def _a_nan_step_skipped(nan_at):
    """ddp at 2 ranks, compressing from the start: rank 1's loss is NaN at step `nan_at`."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = px.prepare(model, opt, bucket_mb=0.004, on_nonfinite="skip",
                            compression=px.PowerSGD(rank=2, start_step=0))
    rows = ROWS // px.world_size()
    mine = slice(px.rank() * rows, (px.rank() + 1) * rows)
    params = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(ROWS, 16, generator=g, dtype=DTYPE), torch.randn(ROWS, 4, generator=g,
                                                                            dtype=DTYPE)
        loss = F.mse_loss(model(x[mine]), y[mine])
        if step == nan_at and px.rank() == 1:
            loss = loss * float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skip's warning
            loss.backward()
            opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in px.unwrap(model).parameters()])
    compressor = engine_of(model).compression
    return params, list(compressor.errors.values()) + list(compressor.qs.values())


def test_a_skipped_nan_step_does_not_carry_into_the_error_feedback(at_2_ranks):
    for params, state in (r["nan"] for r in at_2_ranks[0]):
        assert all(torch.equal(a, b) for a, b in zip(params[1], params[0]))  # skipped
        assert all(torch.isfinite(t).all() for t in state)
        assert all(torch.isfinite(p).all() for p in params[3])
        assert _rel(params[3], params[1]) > 1e-3  # the steps after it trained


# -- checkpoints -----------------------------------------------------------------------------------
RESUME = px.PowerSGD(rank=2, start_step=1, min_compression=1.5)  # the tied embedding is compressed


def _prepared(strategy, seed, bucket_mb=25.0):
    model = make_model(seed)
    opt = make_optimizer(model)
    return px.prepare(model, opt, strategy=strategy, bucket_mb=bucket_mb, compression=RESUME)


def _uninterrupted_and_first_half(path):
    """ddp: 2K steps from the start; and K steps, saved to `path`."""
    model, opt = _prepared("ddp", 0)
    train_steps(model, opt, 2 * K, 0, px.world_size(), px.rank())
    whole = state_of(model, opt)
    model, opt = _prepared("ddp", 0)
    train_steps(model, opt, K, 0, px.world_size(), px.rank())
    px.save(path, model=model, optimizer=opt)
    return whole


def _second_half(path, strategy, bucket_mb):
    """Load, then K more steps; the same with the PowerSGD state cleared after the load (the
    comparison must be able to fail)."""
    out = []
    for forget in (False, True):
        model, opt = _prepared(strategy, 99 + px.rank(), bucket_mb)  # only the load sets values
        px.load(path, model=model, optimizer=opt)
        compressor = engine_of(model).compression
        assert compressor.reductions == K and compressor.compressing
        if bucket_mb < 1:  # the layout differs from the saving run's (one unit there)
            assert len(engine_of(model).units) == 5  # (measured: one per parameter)
        if forget:
            compressor.forget()
        train_steps(model, opt, K, K, px.world_size(), px.rank())
        out.append(state_of(model, opt))
    return out


def _max_rel(got, want) -> float:
    params, optim = got
    worst = max(((params[n] - v).abs().max() / v.abs().max()).item()
                for n, v in want[0].items())
    for name, entries in want[1].items():
        for key, v in entries.items():
            worst = max(worst, ((optim[name][key] - v).abs().max()
                                / v.abs().max().clamp_min(1e-300)).item())
    return worst


# zero2 at 3 ranks with other buckets too (a unit per parameter): the state is per parameter
@pytest.mark.parametrize("loaded", [("zero2", 3, 0.0005), ("ddp", 1, 25.0)],
                         ids=["zero2-3", "ddp-1"])
def test_a_checkpoint_at_2_ranks_resumes_at_another_world_size_as_the_run_goes_on(
        at_2_ranks, loaded):
    results, path = at_2_ranks
    want = results[0]["uninterrupted"]
    with open(os.path.join(path, "manifest.json")) as f:
        saved = json.load(f)["tensors"]
    for name in ("embed.weight", "inp.weight", "out.weight"):
        assert saved[f"powersgd/{name}/error"]["shape"] == [int(saved[f"model/{name}"][
            "shape"][0] * saved[f"model/{name}"]["shape"][1])]
        assert f"powersgd/{name}/q" in saved
    for resumed, forgot in run_ranks(_second_half, loaded[1],
                                     args=(path, loaded[0], loaded[2]), timeout=90):
        # measured: 6.2e-16 (zero2, 3 ranks) and 1.0e-15 (ddp, 1 rank) relative
        assert _max_rel(resumed, want) < 1e-10
        # without the saved error and Q: 0.60 (an AdamW state entry) in both
        assert _max_rel(forgot, want) > 1e-4  # the saved state is what made it equal


# -- the step report -------------------------------------------------------------------------------
def _two_reports():
    return _train("ddp", px.PowerSGD(rank=2, start_step=1), 2, bucket_mb=25)[1]


def test_the_step_report_gives_the_bytes_sent_and_the_compression(at_2_ranks):
    # One unit (bucket_mb=25), float64, 2 ranks, rank 2. Uncompressed: 1739 elements (16x32 +
    # 32 + 32x32 + 32 + 4x32 + 4 gradients, 6 used-flags, 1 signal). Compressed: P of 32x16
    # (32x2) and of 32x32 (32x2), the 4x32 matrix whole (128 < 2 * (4+32) * 2), the biases,
    # flags and signal: 331 elements; then Q (16x2 and 32x2): 96.
    for before, after in (r["reports"] for r in at_2_ranks[0]):
        assert before["powersgd/bytes"] == before["powersgd/dense_bytes"] == 1739 * 8
        assert before["powersgd/compression"] == 1.0
        assert after["powersgd/dense_bytes"] == 1739 * 8
        assert after["powersgd/bytes"] == (331 + 96) * 8
        assert after["powersgd/compression"] == pytest.approx(1739 / 427)
        # what the Comm recorded on the wire: the same bytes, in two all-reduces
        assert (after["all_reduce/count"], after["all_reduce/bytes"]) == (2, 427 * 8)
        # what it cost and saved (none computed before start_step)
        assert after["powersgd/saved_bytes"] == (1739 - 427) * 8 and after["powersgd/compute_s"] > 0
        assert before["powersgd/compute_s"] == 0
