"""Optimizer state in a single process's format (item 4 of the issue "Defects found by running
real training code"): `opt.state_dict()` under ddp, `px.optimizer_state_dict(opt)` under every
strategy and precision (`opt.state_dict()` on one rank alone under sharding is in
test_one_rank_alone.py), and a single process's state loaded with `opt.load_state_dict`
resuming as that process would.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import one_thread
from small_mlp import ROWS, STRATEGIES, batch, rank_rows, rel_err

import phalanx as px
from phalanx.testing import run_ranks


# -- optimizer state in a single process's format ---------------------------------------
class Net(nn.Module):
    """A frozen layer in the path and a layer never used: some parameters get no state."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.frozen(torch.tanh(self.a(x)))))


def _dtype(precision):
    # fp32 runs in float64, where "the same as one process" can be checked to 1e-10
    return torch.float64 if precision == "fp32" else torch.float32


def _net(precision, seed=0):
    torch.manual_seed(seed)
    return Net().to(_dtype(precision))


def _adamw(model):
    """Two groups, and their order not the model's: biases first, then weights."""
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    return torch.optim.AdamW([{"params": biases, "lr": 0.02, "weight_decay": 0.0},
                              {"params": weights, "weight_decay": 0.1}], lr=0.01)


def _step(model, opt, step, precision, world=None):
    x, y = batch(step, ROWS * (world or px.world_size()), dtype=_dtype(precision))
    if world is None:  # on a rank
        x, y = rank_rows(x, y)
    # x 0.01: gradients small enough that fp16's first loss scale (65536) does not overflow,
    # so no step is skipped and the step counts are a single process's
    (0.01 * F.mse_loss(model(x), y)).backward()
    opt.step()
    opt.zero_grad()


def _one_process(precision, steps, snapshot_at=None):
    """The single-process run (fp32; float64 for "fp32"): final parameters and state dict,
    and at `snapshot_at` a copy of the model's and the optimizer's state."""
    with one_thread():
        model = _net(precision)
        opt = _adamw(model)
        snapshot = None
        for step in range(steps):
            if step == snapshot_at:
                snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            _step(model, opt, step, precision, world=2)
        return [p.detach().clone() for p in model.parameters()], opt.state_dict(), snapshot


def _tolerance(precision):
    # fp32 (float64): round-off only (measured 4e-16). bf16/fp16: the state follows gradients
    # computed in low precision; measured 1.35e-2 (bf16) and 1.5e-3 (fp16) relative after 3
    # steps, norm-wise.
    return {"fp32": 1e-10, "bf16": 5e-2, "fp16": 1e-2}[precision]


def assert_state_dict_like(got, want, rtol, context):
    """Same state keys (positions in the param groups), same entries, shapes and values (each
    tensor within rtol, norm-wise), same param groups."""
    assert sorted(got["state"]) == sorted(want["state"]), (
        f"{context}: state keys {sorted(got['state'])}, one process {sorted(want['state'])}")
    for index, entries in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entries), f"{context}: state[{index}]"
        for key, value in entries.items():
            mine = got["state"][index][key]
            where = f"{context}: state[{index}][{key!r}]"
            if not isinstance(value, torch.Tensor):
                assert mine == value, where
                continue
            assert isinstance(mine, torch.Tensor) and mine.shape == value.shape, (
                f"{where}: {getattr(mine, 'shape', mine)} where one process has {value.shape}")
            err = (mine.double() - value.double()).norm().item()
            assert err <= rtol * value.double().norm().item() + 1e-12, f"{where}: off by {err:.3g}"
    assert got["param_groups"] == want["param_groups"], (
        f"{context}: param_groups {got['param_groups']}, one process {want['param_groups']}")


def _ddp_state_dict(precision):
    model = _net(precision)
    opt = _adamw(model)
    model, opt = px.prepare(model, opt, strategy="ddp", precision=precision)
    for step in range(3):
        _step(model, opt, step, precision)
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_ddp_optimizer_state_dict_is_a_single_process_s(precision):
    _, want, _ = _one_process(precision, 3)
    for rank, got in enumerate(run_ranks(_ddp_state_dict, 2, args=(precision,), timeout=60)):
        assert_state_dict_like(got, want, _tolerance(precision), f"ddp {precision} rank {rank}")


def _gathered_state_dict(strategy):
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        model = _net(precision)
        opt = _adamw(model)
        model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
        for step in range(3):
            _step(model, opt, step, precision)
        out[precision] = copy.deepcopy(px.optimizer_state_dict(opt))  # every rank calls it
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_px_optimizer_state_dict_is_a_single_process_s_on_every_rank(strategy):
    wants = {p: _one_process(p, 3)[1] for p in ("fp32", "bf16", "fp16")}
    for rank, out in enumerate(run_ranks(_gathered_state_dict, 2, args=(strategy,),
                                         timeout=120)):
        for precision, got in out.items():
            assert_state_dict_like(got, wants[precision], _tolerance(precision),
                                   f"{strategy} {precision} rank {rank}")


def _resume(strategy, snapshots):
    """Load a single process's model and optimizer state taken after 3 steps, then train
    steps 3..5. Also returns px.optimizer_state_dict right after the load."""
    out = {}
    for precision, (model_state, opt_state) in snapshots.items():
        model = _net(precision, seed=1 + px.rank())  # not the saved weights, on any rank
        opt = _adamw(model)
        model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
        model.load_state_dict(model_state)
        opt.load_state_dict(copy.deepcopy(opt_state))
        loaded = copy.deepcopy(px.optimizer_state_dict(opt))
        for step in range(3, 6):
            _step(model, opt, step, precision)
        out[precision] = (loaded, [p.detach().double().clone()
                                   for p in px.unwrap(model).parameters()])
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_load_state_dict_takes_a_single_process_s_and_resumes_identically(strategy):
    snapshots, wants = {}, {}
    for precision in ("fp32", "bf16", "fp16"):
        params, _, snapshot = _one_process(precision, 6, snapshot_at=3)
        snapshots[precision], wants[precision] = snapshot, params
    param_rtol = {"fp32": 1e-10, "bf16": 2e-2, "fp16": 5e-3}  # measured 7e-17, 2.8e-3, 3.5e-4
    for rank, out in enumerate(run_ranks(_resume, 2, args=(strategy, snapshots), timeout=120)):
        for precision, (loaded, params) in out.items():
            context = f"{strategy} {precision} rank {rank}"
            # what was loaded reads back exactly: the state itself is never cast
            assert_state_dict_like(loaded, snapshots[precision][1], 0.0, context + " after load")
            for i, (a, b) in enumerate(zip(params, wants[precision])):
                assert rel_err(a, b) <= param_rtol[precision], (
                    f"{context}: parameter {i} after resuming is off by {rel_err(a, b):.2e}")
