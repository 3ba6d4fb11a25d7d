"""Exact parity in float64: every strategy, at 2, 3 and 4 ranks, against one process.

The model, the data and the reference are float64, so round-off is about 1e-15 and any
semantic difference (a gradient averaged over the wrong count, a parameter stepped that no rank
gave a gradient, a missed clip, a wrong shard of optimizer state) stands out by many orders of
magnitude. Each rank seeds its generator differently before building the model
(`1234 + rank`) while the reference is built with rank 0's seed, so the initial broadcast in
`px.prepare` is under test too.

After 5 steps the parameters AND the optimizer state (`px.optimizer_state_dict`, the single
process's format) must equal the reference's within RTOL, with the same set of state entries:
a parameter that got no gradient on any rank has no optimizer state and is unchanged, even
under weight decay and momentum, as in one process.
"""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from naive_twin import NaiveDataParallel
from parity import one_thread

import phalanx as px
from phalanx.testing import run_ranks

DTYPE = torch.float64
STEPS = 5
B = 2             # rows per rank and micro-step
BUCKET_MB = 0.002  # 256 float64 elements: several units in every model
CLIP = 0.05       # below the gradient norms of these models, so clipping acts
SEED = 1234
# Measured: the reference against itself with another order of summation (the whole global
# batch in one backward vs each rank's gradients apart, then averaged) differs by at most
# 3.2e-14 relative over this whole matrix at 2, 3 and 4 ranks (2.2e-14 for the MLP, 3e-16 for
# Branchy); RTOL leaves three orders of magnitude for round-off, and a semantic error is
# larger than 1e-6.
RTOL = 1e-10
DIM = 10


class MLP(nn.Module):
    """A frozen layer inside the path, and a layer no forward ever uses."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(16, 16)
        self.never_used = nn.Linear(16, 4)
        self.out = nn.Linear(16, 4)

    def forward(self, x, branch=0):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.frozen(h))
        return self.out(torch.tanh(self.hidden(h)))


class Transformer(nn.Module):
    def __init__(self, vocab=11, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        # bias=False: the attention's key bias has an exactly-zero gradient (softmax ignores a
        # constant added to every score), and AdamW turns the round-off left in that zero into
        # steps of lr * 1e-18 / eps, 1.4e-10 relative after 5 steps (measured): noise, not a
        # difference between strategies, and bigger than RTOL.
        self.layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=24, dropout=0.0,
                                                batch_first=True, bias=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens, branch=0):
        return self.head(self.layer(self.embed(tokens)))


class Branchy(nn.Module):
    """Rank r takes branch r % 2: `left` and `right` get gradients on some ranks only;
    `never_used` on none; `frozen` is frozen."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(DIM, 12)
        self.left = nn.Linear(12, 4)
        self.right = nn.Linear(12, 4)
        self.never_used = nn.Linear(12, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x, branch):
        h = torch.tanh(self.trunk(x))
        return self.frozen(self.left(h) if branch == 0 else self.right(h))


MODELS = {"mlp": MLP, "transformer": Transformer, "branchy": Branchy}


def make_model(name, seed):
    torch.manual_seed(seed)
    return MODELS[name]().to(DTYPE)


def make_optimizer(kind, model):
    # Over all of model.parameters(), frozen ones included, as users often build it: the state
    # keys of a single process then count the frozen parameters' positions too.
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def make_data(name, rows, step):
    g = torch.Generator().manual_seed(1000 + step)
    if name == "transformer":
        return (torch.randint(0, 11, (rows, 5), generator=g),
                torch.randint(0, 11, (rows, 5), generator=g))
    return (torch.randn(rows, DIM, generator=g, dtype=DTYPE),
            torch.randn(rows, 4, generator=g, dtype=DTYPE))


def loss_of(name, model, x, y, rank):
    out = model(x, branch=rank % 2)
    if name == "transformer":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def chunk(x, y, c):
    return x[c * B:(c + 1) * B], y[c * B:(c + 1) * B]


def reference(name, opt_kind, world, accum, clip, order="batch"):
    """One process, the whole global batch (world*accum chunks of B rows) per step, in one
    forward (Branchy: chunk by chunk, chunk c = a*world + r being micro-step a of rank r, which
    takes branch r % 2). `order="ranks"` sums in another order (each rank's gradients apart,
    then averaged), to measure the round-off RTOL has to absorb."""
    with one_thread():
        return _reference(name, opt_kind, world, accum, clip, order)


def _reference(name, opt_kind, world, accum, clip, order):
    model = make_model(name, SEED)
    opt = make_optimizer(opt_kind, model)
    n = world * accum
    for step in range(STEPS):
        x, y = make_data(name, n * B, step)
        if order == "batch" and name != "branchy":  # equal chunks: the mean over all rows
            loss_of(name, model, x, y, 0).backward()
        elif order == "batch":  # each chunk through its rank's branch
            losses = [loss_of(name, model, *chunk(x, y, c), c % world) for c in range(n)]
            (sum(losses) / n).backward()
        else:
            per_rank = []
            for r in range(world):
                for a in range(accum):
                    (loss_of(name, model, *chunk(x, y, a * world + r), r) / accum).backward()
                per_rank.append([p.grad for p in model.parameters()])
                model.zero_grad()
            for i, p in enumerate(model.parameters()):
                grads = [g[i] for g in per_rank if g[i] is not None]
                p.grad = torch.stack(grads).sum(0) / world if grads else None
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def train_on_rank(name, opt_kind, world, accum, clip, strategy, comm=None):
    """One run on this rank: its parameters and the optimizer's state (comm: px.prepare's)."""
    model = make_model(name, SEED + px.rank())  # differs per rank: prepare must broadcast
    opt = make_optimizer(opt_kind, model)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=BUCKET_MB, comm=comm)
    rank = px.rank()
    for step in range(STEPS):
        x, y = make_data(name, world * accum * B, step)
        for a in range(accum):
            last = a == accum - 1
            with contextlib.nullcontext() if last else px.no_sync(model):
                (loss_of(name, model, *chunk(x, y, a * world + rank), rank) / accum).backward()
        if clip:
            px.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()
    if strategy == "zero3":  # no whole parameter outlives a forward: state_dict() gathers
        sd = model.state_dict()
        params = [sd[name] for name, _ in px.unwrap(model).named_parameters()]
    else:
        params = [p.detach().clone() for p in px.unwrap(model).parameters()]
    return params, px.optimizer_state_dict(opt)


COMBOS = [(name, opt, accum, clip)
          for name in MODELS for opt in ("sgd", "adamw") for accum in (1, 2)
          for clip in (False, True)]


def _train_all(world, strategy):
    return {combo: train_on_rank(combo[0], combo[1], world, combo[2], combo[3], strategy)
            for combo in COMBOS}


def assert_close(got, want, context):
    assert isinstance(got, torch.Tensor), f"{context}: {type(got).__name__}, not a tensor"
    assert got.shape == want.shape, f"{context}: shape {list(got.shape)} != {list(want.shape)}"
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    scale = want.double().abs().max().item() if want.numel() else 0.0
    assert err <= RTOL * scale + 1e-13, (
        f"{context}: differs by {err:.3e} (relative {err / max(scale, 1e-300):.3e})")


def assert_state_dicts_equal(got, want, context):
    """`got` has the single-process format and `want`'s values: same state keys (positions in
    the param groups), same entries per key, same shapes and values, same param groups."""
    assert sorted(got["state"]) == sorted(want["state"]), (
        f"{context}: optimizer state for positions {sorted(got['state'])}, "
        f"one process has {sorted(want['state'])}")
    for index, entries in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entries), f"{context}: state[{index}]"
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                assert_close(got["state"][index][key], value, f"{context}: state[{index}][{key!r}]")
            else:
                assert got["state"][index][key] == value, f"{context}: state[{index}][{key!r}]"
    assert len(got["param_groups"]) == len(want["param_groups"]), context
    for g, (a, b) in enumerate(zip(got["param_groups"], want["param_groups"])):
        assert a == b, f"{context}: param_groups[{g}] is {a}, one process has {b}"


@pytest.fixture(scope="module")
def references():
    return {}


# 4 ranks: slow (PHALANX_SLOW=1); 2 and 3 ranks cover an even and an odd world in the suite
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_float64_parity_with_one_process(strategy, world, references):
    results = run_ranks(_train_all, world, args=(world, strategy), timeout=240)
    for combo in COMBOS:
        key = combo + (world,)
        if key not in references:
            references[key] = reference(combo[0], combo[1], world, combo[2], combo[3])
        want_params, want_state = references[key]
        untouched = [i for i in range(len(want_params)) if i not in want_state["state"]]
        for rank, got in enumerate(results):
            params, state = got[combo]
            context = f"{strategy} {combo} world {world} rank {rank}"
            assert len(params) == len(want_params), context
            for i, (a, b) in enumerate(zip(params, want_params)):
                assert a.dtype == DTYPE, f"{context}: parameter {i} is {a.dtype}"
                assert_close(a, b, f"{context}: parameter {i}")
            assert_state_dicts_equal(state, want_state, context)
            # Spelled out: no gradient anywhere -> no state and exactly the initial value.
            initial = list(make_model(combo[0], SEED).parameters())
            for i in untouched:
                assert torch.equal(params[i], initial[i].detach()), f"{context}: parameter {i}"


@pytest.mark.one_process
def test_the_reference_is_not_vacuous():
    """A wrong objective (one rank's data only) or no clip misses RTOL by far: the comparison
    can fail."""
    want, _ = reference("branchy", "adamw", 2, 1, True)
    for other in (reference("branchy", "adamw", 1, 1, True)[0],
                  reference("branchy", "adamw", 2, 1, False)[0]):
        with pytest.raises(AssertionError):
            for i, (a, b) in enumerate(zip(other, want)):
                assert_close(a, b, f"parameter {i}")


@pytest.mark.one_process
def test_rtol_has_headroom_over_the_reference_round_off():
    """RTOL against the round-off it has to absorb, measured on this machine: the reference
    against itself with another order of summation stays 100 times below it."""
    for combo in COMBOS:
        want, _ = reference(combo[0], combo[1], 3, combo[2], combo[3])
        other, _ = reference(combo[0], combo[1], 3, combo[2], combo[3], order="ranks")
        for i, (a, b) in enumerate(zip(other, want)):
            err = (a - b).abs().max().item()
            assert err <= 1e-2 * RTOL * b.abs().max().item() + 1e-16, (combo, i, err)


# -- the naive twin ---------------------------------------------------------------------------
def _clone(t):
    return None if t is None else t.detach().clone()


def _against_the_naive_twin(strategy, steps=3):
    """The same seeds, data and optimizer through phalanx and through NaiveDataParallel (one
    all-reduce per parameter): parameters after every step, and (ddp) every `.grad`."""
    rank, world = px.rank(), px.world_size()
    torch.manual_seed(SEED + rank)
    model = Branchy().to(DTYPE)
    torch.manual_seed(SEED + rank)
    twin = NaiveDataParallel(Branchy().to(DTYPE))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=BUCKET_MB)
    record = []
    for step in range(steps):
        x, y = make_data("branchy", world * B, step)
        mine = chunk(x, y, rank)
        loss_of("branchy", model, *mine, rank).backward()
        loss_of("branchy", twin, *mine, rank).backward()
        twin.sync_grads()
        grads = [(_clone(p.grad), _clone(q.grad))
                 for p, q in zip(px.unwrap(model).parameters(), twin.module.parameters())]
        opt.step()
        twin_opt.step()
        opt.zero_grad()
        twin_opt.zero_grad()
        params = [(p.detach().clone(), q.detach().clone())
                  for p, q in zip(px.unwrap(model).parameters(), twin.module.parameters())]
        record.append((grads, params))
    return record


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_every_step_equals_the_naive_twin(strategy):
    for rank, record in enumerate(run_ranks(_against_the_naive_twin, 3, args=(strategy,),
                                            timeout=120)):
        for step, (grads, params) in enumerate(record):
            for i, (a, b) in enumerate(params):
                err = (a - b).abs().max().item()
                assert err <= 1e-12 * max(b.abs().max().item(), 1.0), (
                    f"{strategy} rank {rank} step {step}: parameter {i} differs by {err:.3e}")
            if strategy != "ddp":
                continue
            for i, (a, b) in enumerate(grads):
                context = f"rank {rank} step {step}: .grad of parameter {i}"
                assert (a is None) == (b is None), (
                    f"{context} is {'None' if a is None else 'set'}, the twin's "
                    f"{'None' if b is None else 'set'}")
                if b is not None:
                    err = (a - b).abs().max().item()
                    assert err <= 1e-12 * max(b.abs().max().item(), 1.0), f"{context}: {err:.3e}"


def _naive_twin_alone():
    """The twin itself against one process: it is an oracle only if it is right."""
    rank, world = px.rank(), px.world_size()
    torch.manual_seed(SEED + rank)
    twin = NaiveDataParallel(Branchy().to(DTYPE))
    opt = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(STEPS):
        x, y = make_data("branchy", world * B, step)
        loss_of("branchy", twin, *chunk(x, y, rank), rank).backward()
        twin.sync_grads()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in twin.module.parameters()], opt.state_dict()


def test_the_naive_twin_matches_one_process():
    want_params, want_state = reference("branchy", "adamw", 3, 1, False)
    for rank, (params, state) in enumerate(run_ranks(_naive_twin_alone, 3, timeout=60)):
        for i, (a, b) in enumerate(zip(params, want_params)):
            assert_close(a, b, f"rank {rank} parameter {i}")
        assert_state_dicts_equal(state, want_state, f"rank {rank}")
