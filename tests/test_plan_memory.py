"""Model-state memory: the published figures, each strategy's formula, and what torch and the
engine really allocate for optimizer state."""

import math

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.engine.policy import POLICIES
from phalanx.planner.memory import model_states, optimizer_state_elements
from phalanx.spec.precisions import PLANNER_PRECISIONS as PRECISIONS
from phalanx.testing import run_ranks


@pytest.mark.one_process
def test_zero_paper_figures_for_7_5b_on_64_gpus():
    # ZeRO (arXiv:1910.02054), Figure 1: 7.5B parameters, N = 64, mixed-precision Adam (K = 12).
    r = px.plan(params=7.5e9, gpus=64, precision="bf16", optimizer="adam")
    published = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6}
    for name, gb in published.items():
        assert round(r[name].model_states_bytes / 1e9, 1) == gb
    # and exactly: (2 + 2 + 12) Psi, 4 Psi + 12 Psi / N, 2 Psi + 14 Psi / N
    psi, n = 7.5e9, 64
    exact = {"ddp": 16 * psi, "zero1": 4 * psi + 12 * psi / n, "zero2": 2 * psi + 14 * psi / n}
    for name, value in exact.items():
        assert r[name].model_states_bytes == value
    # the paper's zero3 is 16 Psi / N (1.9 GB); phalanx's keeps no bf16 copy of its shard (the
    # fp32 master is cast into the gathered buffer at each gather): 14 Psi / N
    assert round(16 * psi / n / 1e9, 1) == 1.9
    assert r["zero3"].model_states_bytes == 16 * psi / n - 2 * psi / n


@pytest.mark.one_process
def test_8b_fp32_adamw_is_32_plus_32_plus_64_gb_and_does_not_fit_replicated():
    r = px.plan(params="8B", gpus=8, precision="fp32", optimizer="adamw", gpu_memory="80GB")
    ddp = r["ddp"]
    assert (ddp.params_bytes, ddp.grads_bytes, ddp.optimizer_bytes) == (32e9, 32e9, 64e9)
    assert not ddp.fits
    assert r.recommended != "ddp"


@pytest.mark.one_process
def test_1b_in_pure_bf16_is_8_gb():
    r = px.plan(params=1e9, gpus=1, precision="bf16-true", optimizer="adamw")
    assert r["ddp"].model_states_bytes == 8e9
    ddp = r["ddp"]
    assert (ddp.params_bytes, ddp.grads_bytes, ddp.optimizer_bytes) == (2e9, 2e9, 4e9)


# The closed forms of the issue, written out independently of the code's (w, g, K) structure.
# zero3 under mixed precision keeps its fp32 master as the shard (no compute-dtype copy between
# uses) on more than one rank; on one it shards nothing and keeps whole parameters.
FORMULAS = {
    ("fp32", "adamw"): {"ddp": lambda p, n: 16 * p, "zero1": lambda p, n: 8 * p + 8 * p / n,
                        "zero2": lambda p, n: 4 * p + 12 * p / n, "zero3": lambda p, n: 16 * p / n},
    ("bf16", "adamw"): {"ddp": lambda p, n: 16 * p, "zero1": lambda p, n: 4 * p + 12 * p / n,
                        "zero2": lambda p, n: 2 * p + 14 * p / n,
                        "zero3": lambda p, n: (16 if n == 1 else 14) * p / n},
    ("fp16", "adam"): {"ddp": lambda p, n: 16 * p, "zero1": lambda p, n: 4 * p + 12 * p / n,
                       "zero2": lambda p, n: 2 * p + 14 * p / n,
                       "zero3": lambda p, n: (16 if n == 1 else 14) * p / n},
    ("bf16-true", "adamw"): {"ddp": lambda p, n: 8 * p, "zero1": lambda p, n: 4 * p + 4 * p / n,
                             "zero2": lambda p, n: 2 * p + 6 * p / n,
                             "zero3": lambda p, n: 8 * p / n},
    ("fp32", "sgd"): {"ddp": lambda p, n: 8 * p, "zero1": lambda p, n: 8 * p,
                      "zero2": lambda p, n: 4 * p + 4 * p / n, "zero3": lambda p, n: 8 * p / n},
    ("fp32", "sgd-momentum"): {"ddp": lambda p, n: 12 * p, "zero1": lambda p, n: 8 * p + 4 * p / n,
                               "zero2": lambda p, n: 4 * p + 8 * p / n,
                               "zero3": lambda p, n: 12 * p / n},
    ("bf16", "sgd"): {"ddp": lambda p, n: 8 * p, "zero1": lambda p, n: 4 * p + 4 * p / n,
                      "zero2": lambda p, n: 2 * p + 6 * p / n,
                      "zero3": lambda p, n: (8 if n == 1 else 6) * p / n},
}


@pytest.mark.one_process
@pytest.mark.parametrize("precision,optimizer", list(FORMULAS))
@pytest.mark.parametrize("world", [1, 4, 64])
def test_each_strategy_matches_its_closed_form(precision, optimizer, world):
    psi = 3_200_000_000  # divisible by every world size here, so no rounding
    r = px.plan(params=psi, gpus=world, precision=precision, optimizer=optimizer)
    for name, formula in FORMULAS[(precision, optimizer)].items():
        assert r[name].model_states_bytes == formula(psi, world), name


@pytest.mark.one_process
def test_frozen_parameters_have_no_gradients_or_optimizer_state():
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10))
    model[0].requires_grad_(False)
    r = px.plan(model, gpus=1, precision="fp32", input_shape="100")
    trainable = 100 * 10 + 10
    total = trainable + 100 * 100 + 100
    assert r["ddp"].params_bytes == 4 * total
    assert r["ddp"].grads_bytes == 4 * trainable
    assert r["ddp"].optimizer_bytes == 8 * trainable


class _Shapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(30, 20)                 # matrix + vector
        self.conv = nn.Conv2d(3, 5, 4)             # 4-D weight: factored over the last two dims
        self.emb = nn.Embedding(50, 7)

    def forward(self, x):
        return self.a(x)


def _state_elements(opt):
    """Elements of per-parameter state tensors, leaving out scalar step counters."""
    return sum(t.numel() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)


@pytest.mark.one_process
@pytest.mark.parametrize("name,make", [
    ("adamw", lambda ps: torch.optim.AdamW(ps)),
    ("adam", lambda ps: torch.optim.Adam(ps)),
    ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1)),
    ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    ("adafactor", lambda ps: torch.optim.Adafactor(ps)),
])
def test_optimizer_state_matches_what_torch_allocates(name, make):
    model = _Shapes()
    opt = make(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    shapes = [tuple(p.shape) for p in model.parameters()]
    trainable = sum(p.numel() for p in model.parameters())
    assert optimizer_state_elements(name, trainable, shapes) == _state_elements(opt)


def _engine_state_bytes(strategy, precision):
    """Optimizer bytes (masters included) and weight bytes per rank after one step. The
    planner's "bf16-true" is px.prepare's precision="fp32" of a model cast to bf16 (see
    phalanx/precisions.py): the parameters are their own masters, the moments bf16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Linear(64, 3))
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = px.prepare(model, opt, strategy=strategy,
                            precision="fp32" if precision == "bf16-true" else precision)
    model(torch.randn(4, 64, dtype=dtype)).float().sum().backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    # Under mixed precision the optimizer steps separate fp32 masters, which key its state
    # (its param groups show the user's parameters between steps: engine/optim.py)
    masters = sum(p.numel() * 4 for p in opt.state) if PRECISIONS[precision].mixed else 0
    weights = sum(p.numel() * p.element_size() for p in px.unwrap(model).parameters())
    return state + masters, weights


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-true"])
def test_optimizer_and_weight_bytes_per_rank_match_the_engine(precision):
    world = 2
    strategies = ["zero1", "zero2"] if precision == "fp32" else ["ddp", "zero1", "zero2"]
    measured = run_ranks(lambda: [_engine_state_bytes(s, precision) for s in strategies], world,
                         timeout=90)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Linear(64, 3))
    r = px.plan(model, gpus=world, precision=precision, optimizer="adamw", input_shape="64",
                backend="gloo")
    for rank_result in measured:
        for strategy, (optimizer_bytes, weight_bytes) in zip(strategies, rank_result):
            # shards are padded to a multiple of the world size: a few elements per unit
            assert optimizer_bytes == pytest.approx(r[strategy].optimizer_bytes, rel=1e-3)
            assert weight_bytes == r[strategy].params_bytes


@pytest.mark.one_process
def test_model_states_function_shards_with_ceiling():
    prec = PRECISIONS["fp32"]
    s = model_states(POLICIES["zero3"], prec, params=10, trainable=10, state_elements=20, world=3)
    assert (s.params, s.grads, s.optimizer) == (math.ceil(40 / 3), math.ceil(40 / 3),
                                                math.ceil(80 / 3))


@pytest.mark.one_process
@pytest.mark.parametrize("compute_bytes", [4, 2])
def test_unit_layout_matches_the_engines_units(compute_bytes):
    """The planner's units from a config are the engine's units of the module built from it,
    and no unit mixes two transformer layers."""
    from phalanx.engine.units import find_blocks, module_units
    from phalanx.planner.layout import unit_sizes
    from phalanx.planner.reference_model import ReferenceTransformer
    from phalanx.planner.transformer import shape_from_config

    shape = shape_from_config({"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4,
                               "num_attention_heads": 4, "intermediate_size": 700,
                               "vocab_size": 3000, "tie_word_embeddings": False})
    with torch.device("meta"):
        model = ReferenceTransformer(shape)
    params = list(model.parameters())
    bucket_mb = 0.5
    runs = module_units(model, params, compute_bytes, bucket_mb)
    engine = [sum(p.numel() for p in run) for run in runs]
    assert unit_sizes(shape.param_shapes(), shape.params(), compute_bytes, bucket_mb,
                      shape.param_blocks()) == engine
    assert len(engine) > 3
    layer_of = {p: i for i, block in enumerate(find_blocks(model)) for p in block.parameters()}
    for run in runs:
        assert len({layer_of.get(p) for p in run}) == 1


@pytest.mark.one_process
def test_the_peak_is_states_plus_kept_buffers_plus_the_largest_moment():
    from phalanx.planner.memory import buffer_bytes, peak_bytes
    prec = PRECISIONS["fp32"]
    psi, n, unit = 10**8, 4, 10**6
    # zero1 keeps full gradients, so it all-reduces even where reduce-scatter is preferred
    z1 = buffer_bytes(POLICIES["zero1"], prec, psi, n, reduce_scatter=True, comm_bytes=None,
                      largest_unit=unit, largest_param=unit)
    assert z1["comm_copies"] == z1["grad_shard"] == z1["grad_pool"] == 0
    states = model_states(POLICIES["zero2"], prec, psi, psi, 2 * psi, n)
    buffers = buffer_bytes(POLICIES["zero2"], prec, psi, n, reduce_scatter=True,
                           comm_bytes=None, largest_unit=unit, largest_param=unit)
    # reduce-scatter: the received shards of the two buckets in flight
    assert buffers["comm_copies"] == 4 * 2 * unit // n
    kept = buffers["grad_pool"]
    assert peak_bytes(states.total, buffers, 10**9, 0) == (
        states.total + kept + 10**9 + 4 * unit, "backward start")
    assert peak_bytes(states.total, buffers, 0, 2 * 10**9) == (
        states.total + kept + 2 * 10**9, "optimizer step")
    # zero2 borrows its full-gradient buckets from a pool of two of the largest, kept
    z2 = buffer_bytes(POLICIES["zero2"], prec, psi, n, reduce_scatter=False, comm_bytes=None,
                      largest_unit=unit, largest_param=unit)
    assert z2["grad_pool"] == 2 * 4 * (unit + n)
    states2 = model_states(POLICIES["zero2"], prec, psi, psi, 2 * psi, n)
    assert peak_bytes(states2.total, z2, 0, 0) == (states2.total + z2["grad_pool"] + 4 * unit,
                                                  "backward start")


@pytest.mark.one_process
def test_the_flat_engine_steps_runs_of_units():
    from phalanx.planner.memory import step_working_bytes
    units = [300, 1000, 700]
    bf16, fp32 = PRECISIONS["bf16"], PRECISIONS["fp32"]
    # mixed precision, a run of one unit (a budget below two units' fp32 gradients): one
    # unit's fp32 gradient (4 B/element), plus Adam's temporaries of that unit alone: one
    # state-sized tensor with foreach, two with the single-tensor loop
    one = 4 * 1000
    assert step_working_bytes("sgd", bf16, units, foreach=False, run_bytes=one) == 4 * 1000
    assert step_working_bytes("adamw", bf16, units, foreach=True,
                              run_bytes=one) == 4 * 1000 + 4 * 1000
    assert step_working_bytes("adamw", bf16, units, foreach=False,
                              run_bytes=one) == 4 * 1000 + 2 * 4 * 1000
    # a budget of two units: 300 and 1000 form a run, then 700 alone
    two = 4 * 1300
    assert step_working_bytes("sgd", bf16, units, foreach=False, run_bytes=two) == 4 * 1300
    assert step_working_bytes("adamw", bf16, units, foreach=True,
                              run_bytes=two) == 4 * 1300 + 4 * 1300
    # fp32: the gradients are views and every unit is stepped in one call
    assert step_working_bytes("sgd", fp32, units, foreach=False) == 0
    assert step_working_bytes("adamw", fp32, units, foreach=True) == 4 * 2000
    assert step_working_bytes("adamw", fp32, units, foreach=False) == 4 * (2 * 700 + 1000)
    # fp32 ddp: all parameters in one call; foreach over all of them, or the single-tensor loop
    # stepping 700 while the result for 1000 is still held
    params = units
    assert step_working_bytes("adamw", fp32, params, foreach=True, per_unit=False) == 4 * 2000
    assert step_working_bytes("adamw", fp32, params, foreach=False,
                              per_unit=False) == 4 * (2 * 700 + 1000)


def _tensors_reachable(*roots):
    """Every tensor held, directly or through containers and phalanx/torch.nn/torch.optim
    objects, by `roots`: what the engine keeps, whatever it calls it."""
    seen, tensors, stack = set(), [], list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            tensors.append(obj)
            if obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__self__") and callable(obj):
            stack.append(obj.__self__)
        elif type(obj).__module__.startswith(("phalanx", "torch.nn", "torch.optim")) \
                and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return tensors


def _storage_bytes(tensors, exclude=()):
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            storages[s.data_ptr()] = s.nbytes()
    return storages


def _engine_kept_and_step_bytes(strategy, precision, bucket_mb):
    torch.manual_seed(0)
    model = _BufferModel()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision,
                            bucket_mb=bucket_mb)
    kept = {}
    step_extra = []

    def sample(*_):  # inside the user's optimizer step: what exists beyond the kept storages
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        step_extra.append(sum(_storage_bytes(grads, exclude=kept).values()))

    opt.register_step_pre_hook(sample)
    for _ in range(2):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        kept = _storage_bytes(_tensors_reachable(model, opt))
    step_extra.clear()
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    return sum(kept.values()), max(step_extra), len(step_extra)


class _BufferModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64),
                                    nn.Linear(64, 3))

    def forward(self, x):
        return self.layers(x)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kept_buffers_and_step_gradient_match_the_engine(precision):
    """What the engine keeps between steps (found by walking it, not by name) is the plan's
    model states plus its kept buffers, the fp32 gradient made inside the step is the plan's
    step working memory (SGD makes no temporaries of its own), and the optimizer is called
    once per planned unit by the flat engine, once in all by fp32 ddp."""
    from phalanx.engine.units import step_run_bytes, step_runs
    from phalanx.planner.layout import unit_sizes
    world, bucket_mb = 2, 0.01  # several units and runs: the pool and the runs matter
    strategies = ["ddp", "zero1", "zero2"]
    measured = run_ranks(lambda: [_engine_kept_and_step_bytes(s, precision, bucket_mb)
                                  for s in strategies], world, timeout=90)
    with torch.device("meta"):
        model = _BufferModel()
    r = px.plan(model, gpus=world, precision=precision, optimizer="sgd-momentum",
                input_shape="64", backend="gloo", bucket_mb=bucket_mb)
    for rank_result in measured:
        for strategy, (kept, step_grad, calls) in zip(strategies, rank_result):
            plan = r[strategy]
            planned = (plan.model_states_bytes + plan.buffers_detail["grad_pool"]
                       + plan.buffers_detail["comm_buffers"])
            # padding of shards to the world size and fp32 ddp's used-flags: a few elements
            assert kept == pytest.approx(planned, rel=2e-3), strategy
            assert step_grad == plan.step_working_bytes, strategy
            if strategy == "zero2":  # the pool (of the units that borrow) is more than the
                # tolerance: a wrong pool would fail the comparison above
                assert plan.buffers_detail["grad_pool"] > 2 * 2e-3 * planned
            if precision == "bf16":
                assert step_grad > 0
            shapes = [tuple(p.shape) for p in model.parameters()]
            units = unit_sizes(shapes, None, 4 if precision == "fp32" else 2, bucket_mb)
            assert len(units) > 2
            # fp32: one call over every unit; bf16: one per run of units (units.step_runs)
            shards = [-(-u // (1 if strategy == "ddp" else world)) for u in units]
            runs = step_runs([4 * u for u in shards], step_run_bytes(bucket_mb))
            assert calls == (1 if precision == "fp32" else len(runs)), strategy
            if precision == "bf16":
                assert len(runs) > 1  # the runs, not one call, are under test
