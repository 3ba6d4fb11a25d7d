"""Loops users write that are not the textbook one: each must train as in one process."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import assert_params_close
from torch.utils.checkpoint import checkpoint

import phalanx as px
from phalanx.comm.collectives import Comm
from phalanx.testing import run_ranks
from phalanx.world import runtime

STRATEGIES = [("ddp", "fp32"), ("zero1", "fp32"), ("zero2", "fp32"), ("ddp", "bf16")]


class Reentrant(nn.Module):
    """Checkpointed with use_reentrant=True: a backward nested inside the user's backward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=True)
        return self.c(h)


def _data(step, rows):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def _loop(strategy, precision, world, optimizer_kind="sgd", steps=3, backwards=2,
          reduce_scatter=False):
    """`backwards` backward calls per step WITHOUT no_sync, then one step (accumulation the
    plain-PyTorch way). On a rank when `strategy` is set; the single-process reference else."""
    torch.manual_seed(3)
    model = Reentrant()
    if optimizer_kind == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank = 0
    if strategy is not None:
        # reduce_scatter: the NCCL path, which gloo also runs (slower)
        comm = Comm(runtime.default_group(), prefer="reduce_scatter") if reduce_scatter else None
        model, opt = px.prepare(model, opt, strategy=strategy, precision=precision, comm=comm)
        rank = px.rank()
    for step in range(steps):
        x, y = _data(step, 4 * world * backwards)
        for k in range(backwards):
            if strategy is None:  # every rank's chunk of micro-step k, averaged over ranks
                rows = slice(4 * world * k, 4 * world * (k + 1))
                loss = F.mse_loss(model(x[rows]), y[rows])
            else:
                rows = slice(4 * (world * k + rank), 4 * (world * k + rank + 1))
                loss = F.mse_loss(model(x[rows]), y[rows])
            loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().float().clone() for p in px.unwrap(model).parameters()]


@pytest.mark.parametrize("strategy,precision", STRATEGIES)
def test_backward_twice_without_no_sync_and_reentrant_checkpointing(strategy, precision):
    want = _loop(None, None, 2)
    rtol = 1e-5 if precision == "fp32" else 2e-2
    for got in run_ranks(_loop, 2, args=(strategy, precision, 2), timeout=120):
        assert_params_close(got, want, rtol=rtol, context=f"{strategy} {precision}")


def _loop_and_kinds(*args):
    from phalanx.comm import records as collectives
    return _loop(*args), set(collectives.bytes_by_kind())


def test_reduce_scatter_path_accumulates_exactly():
    """zero2 with the primitive NCCL uses (reduce-scatter): gloo runs it too. zero1 keeps full
    gradients, so it all-reduces whatever the preference."""
    want = _loop(None, None, 2)
    for got, kinds in run_ranks(_loop_and_kinds, 2, args=("zero2", "fp32", 2, "sgd", 3, 2, True),
                                timeout=120):
        assert "reduce_scatter" in kinds
        assert_params_close(got, want, context="zero2 reduce-scatter")


def test_adagrad_is_sharded_exactly():
    want = _loop(None, None, 2, optimizer_kind="adagrad", backwards=1)
    for got in run_ranks(_loop, 2, args=("zero2", "fp32", 2, "adagrad", 3, 1), timeout=120):
        assert_params_close(got, want, context="zero2 adagrad")


def _bf16_with_batchnorm_frozen_and_scheduler(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model[0].requires_grad_(False)  # frozen, yet in the optimizer, as users often leave it
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy=strategy, precision="bf16")
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # after prepare
    frozen = px.unwrap(model)[0].weight.detach().clone()
    for step in range(3):
        x, y = _data(step, 8)
        F.mse_loss(model(x), y).backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
    return (opt.param_groups[0]["lr"], torch.equal(frozen, px.unwrap(model)[0].weight),
            model(x).dtype)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_bf16_with_batchnorm_frozen_layers_and_a_scheduler_made_after_prepare(strategy):
    for lr, frozen_unchanged, dtype in run_ranks(_bf16_with_batchnorm_frozen_and_scheduler, 2,
                                                 args=(strategy,), timeout=120):
        assert lr == pytest.approx(0.1 * 0.5**3)
        assert frozen_unchanged and dtype == torch.float32


def _norms(strategy, norm_type):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy=strategy)
    x, y = _data(0, 4 * px.world_size())
    mine = slice(4 * px.rank(), 4 * px.rank() + 4)
    F.mse_loss(model(x[mine]), y[mine]).backward()
    return px.clip_grad_norm_(model, 1e-4, norm_type=norm_type).item()


@pytest.mark.parametrize("norm_type", [1.0, 3.0, float("inf")])
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_clip_norms_of_every_type_equal_torch(strategy, norm_type):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    x, y = _data(0, 8)
    F.mse_loss(model(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-4, norm_type=norm_type).item()
    for got in run_ranks(_norms, 2, args=(strategy, norm_type), timeout=60):
        assert got == pytest.approx(want, rel=1e-5)


def _unfreeze_after_prepare(strategy):
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy=strategy)
    px.unwrap(model)[0].requires_grad_(True)
    model(torch.randn(2, 6))


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_unfreezing_after_prepare_is_refused_on_every_rank(strategy):
    from phalanx.testing import RanksFailed
    with pytest.raises(RanksFailed) as info:
        run_ranks(_unfreeze_after_prepare, 2, args=(strategy,), timeout=60)
    assert "2 of 2 ranks failed" in str(info.value)
    assert "trainable parameters changed after px.prepare" in str(info.value)


def _scheduler_before_prepare(strategy):
    """Accelerate's and Lightning's order: the scheduler is built over the optimizer before
    px.prepare; on a rank when `strategy` is set, else the one-process reference."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    rows = slice(0, 8)  # the reference: the global batch of 2 ranks
    if strategy is not None:
        model, opt = px.prepare(model, opt, strategy=strategy)
        rows = slice(4 * px.rank(), 4 * px.rank() + 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = _data(step, 8)
            F.mse_loss(model(x[rows].double()), y[rows].double()).backward()
            opt.step()
            scheduler.step()
            opt.zero_grad()
    said = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)
            or "optimizer.step()" in str(w.message)]
    return said, opt.param_groups[0]["lr"], [v.clone() for v in model.state_dict().values()]


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_scheduler_built_before_prepare_steps_without_a_warning(strategy):
    """It warned 'optimizer.step() has been overridden after learning rate scheduler
    initialization' on every scheduler.step() under zero2 and zero3 (whose step replaces the
    optimizer's), though the scheduler's own wrapper still ran at every step."""
    _, want_lr, want = _scheduler_before_prepare(None)
    for said, lr, got in run_ranks(_scheduler_before_prepare, 2, args=(strategy,), timeout=120):
        assert said == [], f"{strategy}: {said}"
        assert lr == pytest.approx(want_lr)
        assert_params_close(got, want, rtol=1e-12, context=strategy)
