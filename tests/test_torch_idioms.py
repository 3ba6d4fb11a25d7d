"""torch's own spellings and habits on a prepared model, each against plain PyTorch in one
process: torch.nn.utils.clip_grad_norm_, DDP's require_backward_grad_sync for accumulation, a
model with nothing to train, one rank left in eval mode, torch.compile after px.prepare (items
7, 9, 10 and 13 of the issue "Defects found by running real training code").
"""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import one_thread
from small_mlp import ROWS, STRATEGIES, batch, mlp, rank_rows, rel_err

import phalanx as px
from phalanx.testing import run_ranks


# -- torch's own spellings: clip_grad_norm_ and require_backward_grad_sync --------------
def _torch_clip(world, strategy=None):
    """torch.nn.utils.clip_grad_norm_ over the model's parameters, then a step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if strategy is not None:
        model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=0.001)
    norms = []
    for step in range(2):
        x, y = batch(step, ROWS * world)
        if strategy is not None:
            x, y = rank_rows(x, y)
        F.mse_loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
        opt.step()
        opt.zero_grad()
    return norms, [p.detach().clone() for p in px.unwrap(model).parameters()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_clip_grad_norm_returns_the_global_norm_and_clips(strategy):
    with one_thread():
        want_norms, want_params = _torch_clip(2)
    assert all(n > 0.05 for n in want_norms)  # clipping acts
    for rank, (norms, params) in enumerate(run_ranks(_torch_clip, 2, args=(2, strategy),
                                                     timeout=60)):
        assert norms == pytest.approx(want_norms, rel=1e-5), f"{strategy} rank {rank}"
        for i, (a, b) in enumerate(zip(params, want_params)):
            assert rel_err(a, b) <= 1e-5, f"{strategy} rank {rank}: parameter {i}"


def _accumulate(world, strategy=None, idiom=None, steps=3):
    """Two micro-steps per step, synchronised by DDP's flag (nanoGPT) or px.no_sync. Returns
    the parameters and, per step, the gradients after the first micro-step next to this
    rank's own gradients of it (computed on a plain copy of the model)."""
    model = mlp()
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if strategy is not None:
        model, opt = px.prepare(model, opt, strategy=strategy)
    first = []
    for step in range(steps):
        x, y = batch(step, 2 * ROWS * world)
        if strategy is None:  # both micro-steps of every rank in one backward
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            continue
        for micro in range(2):
            c = micro * world + px.rank()
            rows = slice(c * ROWS, (c + 1) * ROWS)
            last = micro == 1
            if idiom == "flag":
                model.require_backward_grad_sync = last
                (F.mse_loss(model(x[rows]), y[rows]) / 2).backward()
            else:
                with contextlib.nullcontext() if last else px.no_sync(model):
                    (F.mse_loss(model(x[rows]), y[rows]) / 2).backward()
            if micro == 0 and strategy == "ddp":
                plain.load_state_dict(px.unwrap(model).state_dict())
                plain.zero_grad()
                (F.mse_loss(plain(x[rows]), y[rows]) / 2).backward()
                first.append([(p.grad.clone(), q.grad.clone()) for p, q in
                              zip(px.unwrap(model).parameters(), plain.parameters())])
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in px.unwrap(model).parameters()], first


def _accumulate_all(strategy):
    return {idiom: _accumulate(px.world_size(), strategy, idiom) for idiom in ("flag", "no_sync")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_require_backward_grad_sync_false_accumulates_like_no_sync(strategy):
    with one_thread():
        want, _ = _accumulate(2)
    for rank, out in enumerate(run_ranks(_accumulate_all, 2, args=(strategy,), timeout=60)):
        for idiom, (params, first) in out.items():
            context = f"{strategy} {idiom} rank {rank}"
            for i, (a, b) in enumerate(zip(params, want)):
                assert rel_err(a, b) <= 1e-5, f"{context}: parameter {i} off by {rel_err(a, b):.2e}"
            # Under ddp the gradients of a micro-step without sync are this rank's own, as in
            # PyTorch's DDP: nothing was communicated.
            for step, pairs in enumerate(first):
                for i, (got, own) in enumerate(pairs):
                    assert rel_err(got, own) <= 1e-6, (
                        f"{context} step {step}: .grad of parameter {i} after a micro-step "
                        "without sync is not this rank's own gradient (it was averaged)")


# -- a model with nothing to train ------------------------------------------------------
def _frozen(strategy, input_grad):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).requires_grad_(False)
    plain = copy.deepcopy(model)
    prepared, _ = px.prepare(model, None, strategy=strategy)
    x, _ = batch(0, ROWS * px.world_size())
    x, _ = rank_rows(x, x)
    if input_grad:  # gradients for the inputs only, through a frozen model (saliency maps)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        prepared(xs[0]).pow(2).sum().backward()
        plain(xs[1]).pow(2).sum().backward()
        return torch.equal(xs[0].grad, xs[1].grad)
    train_out = prepared(x)
    prepared.eval()
    with torch.no_grad():
        eval_out = prepared(x)
    return torch.equal(train_out, plain(x)) and torch.equal(eval_out, plain(x))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_model_with_nothing_to_train_prepares_and_runs_forward(strategy):
    assert all(run_ranks(_frozen, 2, args=(strategy, False), timeout=60))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_frozen_model_gives_gradients_for_its_inputs(strategy):
    assert all(run_ranks(_frozen, 2, args=(strategy, True), timeout=60))


# -- one rank in eval mode while the others train --------------------------------------
def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _one_rank_in_eval(strategy, steps=2):
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy=strategy)
    if px.rank() == 1:
        model.eval()  # left in eval mode by mistake; still a forward with gradients
    for step in range(steps):
        x, y = rank_rows(*batch(step, ROWS * px.world_size()))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in px.unwrap(model).parameters()]


def _eval_reference(steps=2):
    """Rank 1's forward uses the running statistics rank 0 had before its own forward (they
    are broadcast from rank 0 first); rank 0 trains on batch statistics."""
    model = _bn_model()
    bn = model[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step, ROWS * 2)
        # Rank 1's own copy of the statistics: its backward must not see rank 0's update.
        shared = bn.running_mean, bn.running_var
        bn.running_mean, bn.running_var = shared[0].clone(), shared[1].clone()
        model.eval()
        loss1 = F.mse_loss(model(x[ROWS:]), y[ROWS:])
        bn.running_mean, bn.running_var = shared
        model.train()
        loss0 = F.mse_loss(model(x[:ROWS]), y[:ROWS])
        ((loss0 + loss1) / 2).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rank_in_eval_mode_does_not_hang_the_others(strategy):
    with one_thread():
        want = _eval_reference()
    results = run_ranks(_one_rank_in_eval, 2, args=(strategy,), timeout=30)
    for rank, params in enumerate(results):
        for i, (a, b) in enumerate(zip(params, want)):
            assert torch.equal(a, results[0][i]), f"{strategy}: replicas differ"
            assert rel_err(a, b) <= 1e-5, f"{strategy} rank {rank}: parameter {i}"


# -- torch.compile after prepare --------------------------------------------------------
def _compiled(world, strategy=None):
    model = mlp()
    original = model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if strategy is not None:
        model, opt = px.prepare(model, opt, strategy=strategy)
        model = torch.compile(model, backend="eager")
    rank = px.rank() if strategy is not None else 0
    norms = []
    for step in range(2):
        x, y = batch(step, 2 * ROWS * world)
        if strategy is None:
            F.mse_loss(model(x), y).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2).item())
        else:
            for micro in range(2):
                c = micro * world + rank
                rows = slice(c * ROWS, (c + 1) * ROWS)
                with px.no_sync(model) if micro == 0 else contextlib.nullcontext():
                    (F.mse_loss(model(x[rows]), y[rows]) / 2).backward()
            norms.append(px.clip_grad_norm_(model, 0.2).item())
        opt.step()
        opt.zero_grad()
    return px.unwrap(model) is original, norms, [p.detach().clone() for p in original.parameters()]


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_no_sync_clip_and_unwrap_work_on_a_compiled_model(strategy):
    with one_thread():
        _, want_norms, want = _compiled(2)
    assert all(n > 0.2 for n in want_norms)  # clipping acts
    for rank, (is_original, norms, params) in enumerate(
            run_ranks(_compiled, 2, args=(2, strategy), timeout=120)):
        assert is_original, f"{strategy} rank {rank}: px.unwrap(compiled) is not the module"
        assert norms == pytest.approx(want_norms, rel=1e-5), f"{strategy} rank {rank}"
        for i, (a, b) in enumerate(zip(params, want)):
            assert rel_err(a, b) <= 1e-5, f"{strategy} rank {rank}: parameter {i}"
