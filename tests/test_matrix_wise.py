"""Optimizers that need whole matrices (torch.optim.Muon, torch.optim.Adafactor, a user's own
declared with px.matrix_wise) under ddp, zero1, zero2 and zero3 train exactly as one process
with the global batch: each whole parameter is stepped on one owner rank (engine/owners.py).

Everything is float64, so the comparisons hold to 1e-10 on any CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import RanksFailed, engine_of, run_ranks

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
STEPS, B = 5, 2


class NormalizedMomentum(torch.optim.Optimizer):
    """A toy matrix-wise optimizer of the kind users write (a Muon with an auxiliary group):
    groups flagged `whole` step by momentum normalised by the whole matrix's Frobenius norm,
    the others by element-wise momentum SGD."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum, "whole": False})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                update = buf / buf.norm().clamp(min=1e-12) if group["whole"] else buf
                p.add_(update, alpha=-group["lr"])


px.matrix_wise(NormalizedMomentum, whole=lambda group, p: group["whole"])


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    bias = kind != "muon"  # Muon holds matrices only
    layers = [nn.Embedding(11, 8), nn.Flatten(), nn.Linear(24, 16, bias=bias), nn.Tanh(),
              nn.Linear(16, 16, bias=bias)]
    if bias:
        layers.append(nn.LayerNorm(16))
    layers += [nn.Tanh(), nn.Linear(16, 5, bias=bias)]
    return nn.Sequential(*layers).double()


def make_optimizer(kind: str, model: nn.Module):
    if kind == "muon":
        return torch.optim.Muon(model.parameters(), lr=0.05, weight_decay=0.1)
    if kind == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=0.05, weight_decay=0.01)
    if kind == "chain":  # torch's documented pair: Muon over the matrices, AdamW the rest
        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        return px.chain_optimizers(torch.optim.Muon(matrices, lr=0.05, weight_decay=0.1),
                                   torch.optim.AdamW(others, lr=0.01, weight_decay=0.1))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return NormalizedMomentum([{"params": matrices, "whole": True}, {"params": others}])


def batches(world: int, steps: int = STEPS, b: int = B):
    g = torch.Generator().manual_seed(1)
    n = world * b * steps
    x, y = torch.randint(0, 11, (n, 3), generator=g), torch.randn(n, 5, generator=g,
                                                                 dtype=torch.float64)
    return [(x[s * world * b:(s + 1) * world * b], y[s * world * b:(s + 1) * world * b])
            for s in range(steps)]


def reference(kind: str, world: int, steps: int = STEPS):
    model = make_model(kind)
    opt = make_optimizer(kind, model)
    for x, y in batches(world, steps):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def train_prepared(kind, strategy, steps=STEPS, **kwargs):
    model = make_model(kind)
    opt = make_optimizer(kind, model)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=0.0005, **kwargs)
    world, r = px.world_size(), px.rank()
    for x, y in batches(world, steps):
        F.mse_loss(model(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trained_everywhere(kinds):
    out = {}
    for kind in kinds:
        for strategy in STRATEGIES:
            model, opt = train_prepared(kind, strategy)
            engine = engine_of(model)
            wholes = engine.wholes.wholes if engine.wholes is not None else []
            out[kind, strategy] = {
                "weights": _weights(model), "state": opt.state_dict(),
                "owners": sorted((tuple(w.param.shape), w.owner) for w in wholes),
                "a2a": engine.comm.bytes_by_kind.get("all_to_all", 0)}
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _state_diff(got: dict, want: dict) -> float:
    """The largest difference between two optimizer states in the single-process format."""
    assert got["state"].keys() == want["state"].keys(), (got["state"].keys(), want["state"].keys())
    worst = 0.0
    for index, entry in want["state"].items():
        assert got["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                worst = max(worst, (got["state"][index][key].double() - value.double())
                            .abs().max().item())
    return worst


# 3 ranks: slow (PHALANX_SLOW=1), with the 4-rank shard groups; 2 ranks in the suite
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_matrix_wise_optimizers_match_one_process(world):
    kinds = ("muon", "adafactor", "toy", "chain")
    results = run_ranks(_trained_everywhere, world, args=(kinds,), timeout=300)
    for kind in kinds:
        model, opt = reference(kind, world)
        want, want_state = _weights(model), opt.state_dict()
        for strategy in STRATEGIES:
            for rank, got in enumerate(results):
                row = got[kind, strategy]
                context = f"{kind} {strategy} world {world} rank {rank}"
                assert _max_diff(row["weights"], want) < 1e-10, context
                assert _state_diff(row["state"], want_state) < 1e-10, context
                sharded = strategy != "ddp"
                # the matrices go whole to owners under sharding, and the owners are spread
                assert bool(row["owners"]) == sharded, context
                assert (row["a2a"] > 0) == sharded, context
                if sharded:
                    assert len({o for _, o in row["owners"]}) > 1, context
            assert all(r[kind, strategy]["owners"] == results[0][kind, strategy]["owners"]
                       for r in results), f"{kind} {strategy}: ranks disagree on the owners"


def _state_is_spread(strategy):
    """Each rank holds the optimizer state of the matrices it owns, and only those."""
    model, opt = train_prepared("muon", strategy, steps=2)
    engine = engine_of(model)
    held = sum(v.numel() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
    mine = sum(w.numel for w in engine.wholes.owned())
    report = px.step_stats(model)
    return held, mine, sum(p.numel() for p in px.unwrap(model).parameters()), \
        report.get("all_to_all/bytes", 0)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_state_lives_on_the_owners_and_the_exchange_is_reported(strategy):
    results = run_ranks(_state_is_spread, 3, args=(strategy,), timeout=120)
    total = results[0][2]
    assert sum(r[0] for r in results) == total  # Muon: one momentum per element, once
    for held, mine, _, a2a in results:
        assert held == mine
        assert held < total  # nobody holds it all
        assert a2a > 0       # the step report counts the owners' exchange


def _global_batches():
    """Five steps of a global batch of 6, whatever the world size (1, 2, 3 and 6 divide it)."""
    return batches(1, STEPS, 6)


def _steps(model, opt, data):
    world, r = px.world_size(), px.rank()
    b = 6 // world
    for x, y in data:
        F.mse_loss(model(x[r * b:(r + 1) * b]), y[r * b:(r + 1) * b]).backward()
        opt.step()
        opt.zero_grad()


def _save_then_resume(kind, path, phase, strategy):
    model = make_model(kind)
    opt = make_optimizer(kind, model)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=0.0005)
    if phase == "save":
        _steps(model, opt, _global_batches()[:3])
        px.save(path, model=model, optimizer=opt)
        return None
    px.load(path, model=model, optimizer=opt)
    _steps(model, opt, _global_batches()[3:])
    return _weights(model)


@pytest.mark.parametrize("kind,before,after", [
    ("muon", (2, "zero2"), (3, "zero3")),
    ("adafactor", (3, "zero3"), (2, "zero1")),
    ("toy", (2, "zero1"), (1, "ddp")),
    ("chain", (2, "zero2"), (3, "zero3")),
])
def test_resumes_at_another_world_size_and_strategy(tmp_path, kind, before, after):
    """Three steps at one world size and strategy, saved; two more at another: the weights
    equal five steps of one process with the same global batch of 6."""
    path = str(tmp_path / "ckpt")
    run_ranks(_save_then_resume, before[0], args=(kind, path, "save", before[1]), timeout=120)
    got = run_ranks(_save_then_resume, after[0], args=(kind, path, "load", after[1]),
                    timeout=120)
    model = make_model(kind)
    opt = make_optimizer(kind, model)
    for x, y in _global_batches():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for rank, weights in enumerate(got):
        assert _max_diff(weights, _weights(model)) < 1e-10, f"{kind} {before}->{after} {rank}"


class Whitening(torch.optim.Optimizer):
    """Not declared: its update mixes elements of a parameter."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])


def _refused(case):
    model = make_model("toy")
    if case == "undeclared":
        px.prepare(model, Whitening(model.parameters()), strategy="zero2")
    elif case == "offload":
        px.prepare(model, make_optimizer("adafactor", model), strategy="zero2",
                   offload="optimizer")
    elif case == "muon without the biases":
        muon = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
        px.prepare(model, muon, strategy="zero2")
    return "prepared"


@pytest.mark.parametrize("case,words", [
    ("undeclared", ["Whitening is not an optimizer whose update is element-wise",
                    "px.matrix_wise(cls", "Muon"]),
    ("offload", ["offload='optimizer' with Adafactor", "offload=None"]),
    ("muon without the biases", ["are not in the optimizer", "torch.optim.Muon takes matrices",
                                 "px.chain_optimizers(muon, adamw)", "px.matrix_wise(cls, "]),
])
def test_what_cannot_shard_is_refused_on_every_rank(case, words):
    with pytest.raises(RanksFailed) as caught:
        run_ranks(_refused, 2, args=(case,), timeout=60)
    text = str(caught.value)
    assert "2 of 2 ranks failed" in text
    for word in words:
        assert word in text, text


def test_declarations_are_checked():
    with pytest.raises(TypeError, match="declare an optimizer class"):
        px.matrix_wise(lambda p: p)
    with pytest.raises(TypeError, match="declare an optimizer class"):
        px.element_wise(int)


def _low_precision(precision):
    out = {}
    for strategy in ("ddp", "zero2", "zero3"):
        model, _ = train_prepared("adafactor", strategy, precision=precision)
        out[strategy] = _weights(model)
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_owners_step_what_ddp_steps(precision):
    """Under bf16 and fp16 (gradients cast to the master dtype, and unscaled, a few units at a
    time, each run's gather on the wire while the run before steps) the sharded strategies
    end where ddp, which steps every matrix on every rank, ends."""
    for rank, got in enumerate(run_ranks(_low_precision, 2, args=(precision,), timeout=120)):
        for strategy in ("zero2", "zero3"):
            assert _max_diff(got[strategy], got["ddp"]) < 1e-10, f"{precision} {strategy} {rank}"


def _matrices():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48, bias=False), nn.Tanh(), nn.Linear(48, 48, bias=False),
                         nn.Tanh(), nn.Linear(48, 5, bias=False))


def _exchanged_bytes(strategy, steps=2):
    from phalanx.comm import records
    model = _matrices()
    model, opt = px.prepare(model, torch.optim.Muon(model.parameters(), lr=0.02),
                            strategy=strategy)

    def step():
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    step()
    records.reset_counts()
    for _ in range(steps):
        step()
    return records.bytes_by_kind().get("all_to_all", 0) / steps


@pytest.mark.parametrize("world", [2, 3])
def test_planned_exchange_matches_the_collectives_counter(world):
    """The planner's all-to-all payload per step (memory.py's WholeTerms: 3E/n elements of the
    master dtype a rank) is the mean over the ranks of what the Comm counted."""
    for strategy in ("zero1", "zero3"):
        counted = run_ranks(_exchanged_bytes, world, args=(strategy,), timeout=120)
        planned = px.plan(_matrices(), gpus=world, optimizer="muon", strategy=strategy,
                          backend="gloo", input_shape="32")[strategy]
        assert sum(counted) / world == pytest.approx(
            planned.comm_payload_bytes["all_to_all"], rel=1e-3), (strategy, counted)
        ddp = px.plan(_matrices(), gpus=world, optimizer="muon", strategy="ddp",
                      backend="gloo", input_shape="32")["ddp"]
        assert "all_to_all" not in ddp.comm_payload_bytes
        elementwise = px.plan(_matrices(), gpus=world, optimizer="sgd-momentum",
                              strategy=strategy, backend="gloo", input_shape="32")[strategy]
        # the owner's working memory: the largest matrix (48 x 48) whole, gradient and master,
        # and Muon's temporaries for it
        assert planned.step_working_bytes - elementwise.step_working_bytes >= 2 * 48 * 48 * 4


def _hybrid():
    return {kind: _weights(train_prepared(kind, "zero2", shard_size=2)[0])
            for kind in ("muon", "adafactor")}


@pytest.mark.slow  # 4 ranks on 2 cores (PHALANX_SLOW=1)
def test_shard_groups_step_their_matrices_on_owners_within_the_group():
    """shard_size=2 on 4 ranks: each group of two shards (and owns) the matrices apart, the
    gradients averaged across the groups first."""
    results = run_ranks(_hybrid, 4, timeout=300)
    for kind in ("muon", "adafactor"):
        want = _weights(reference(kind, 4)[0])
        for rank, got in enumerate(results):
            assert _max_diff(got[kind], want) < 1e-10, f"{kind} rank {rank}"


def _capped(kind, strategy):
    from phalanx.engine import flat
    flat.PIECE_CAP = 40  # every matrix in several pieces on each rank
    model, opt = train_prepared(kind, strategy)
    return _weights(model), opt.state_dict()


@pytest.mark.parametrize("kind", ["muon", "toy"])
def test_pieces_cut_at_the_cap_gather_whole_on_the_owner(kind):
    """flat.py's cap cuts a rank's slice of a matrix into several pieces: the owners' exchange
    sends and receives them in order, and training is one process's."""
    model, opt = reference(kind, 2)
    want, want_state = _weights(model), opt.state_dict()
    for strategy in ("zero2", "zero3"):
        for weights, state in run_ranks(_capped, 2, args=(kind, strategy), timeout=120):
            assert _max_diff(weights, want) < 1e-10, (kind, strategy)
            assert _state_diff(state, want_state) < 1e-10, (kind, strategy)


def _scheduled(strategy):
    model = make_model("chain")
    opt = make_optimizer("chain", model)
    if strategy is not None:
        model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=0.0005)
    muon = opt.optimizers[0]
    schedule = torch.optim.lr_scheduler.StepLR(muon, step_size=1, gamma=0.5)
    world, r = px.world_size(), px.rank()
    for x, y in batches(world if strategy is not None else 2):
        if strategy is not None:
            x, y = x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    return _weights(model), muon.param_groups[0]["lr"]


def test_a_scheduler_on_one_of_the_chained_optimizers():
    """px.chain_optimizers(muon, adamw) under zero2, with a StepLR on the Muon alone: the
    weights and the learning rate are one process's."""
    want, want_lr = run_ranks(_scheduled, 1, args=(None,), timeout=60)[0]
    for weights, lr in run_ranks(_scheduled, 2, args=("zero2",), timeout=120):
        assert lr == want_lr == 0.05 * 0.5 ** STEPS
        assert _max_diff(weights, want) < 1e-10


@pytest.mark.one_process
def test_chained_optimizers_are_checked():
    model = make_model("chain")
    with pytest.raises(TypeError, match="torch.optim.Optimizer instances"):
        px.chain_optimizers()
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="held by two of the chained optimizers"):
        px.chain_optimizers(adamw, torch.optim.SGD(model.parameters(), lr=0.1))
