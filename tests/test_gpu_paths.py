"""The paths that differ on a GPU machine, checked on the CPU where they can be: which device a
rank takes, the inputs' move to it, px.data_loader's batches on it, how px.spawn starts workers,
the meta build's values under per-rank seeds, the step report's hands off the user's
peak-memory statistics, and outputs kept in the compute dtype (`output_dtype=None`).
(benchmarks/gpu_accept.py checks the rest on a machine with a GPU.)"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx._tree import to_device
from phalanx.comm.records import StepCounter
from phalanx.launch import spawn as spawn_module
from phalanx.observe.step_report import StepClock
from phalanx.testing import run_ranks
from phalanx.world import runtime


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` GPUs: what torch.cuda answers, and the device set."""
    chosen = []

    def make(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen
    return make


@pytest.mark.one_process
def test_a_rank_takes_its_gpu_under_nccl_and_the_cpu_under_gloo(gpus):
    chosen = gpus(2)
    assert runtime._pick_device(1, "nccl") == torch.device("cuda", 1) and chosen == [1]
    assert runtime._pick_device(1, "gloo") == torch.device("cpu")
    # gloo ranks may share GPUs: rank 3 of a node with 2 GPUs computes on GPU 1
    assert runtime._pick_device(3, "gloo", "cuda") == torch.device("cuda", 1)
    assert runtime._pick_device(0, "gloo", "cuda:1") == torch.device("cuda", 1)


@pytest.mark.one_process
def test_more_nccl_ranks_than_gpus_is_an_error_that_names_the_fix(gpus):
    gpus(2)
    with pytest.raises(ValueError) as caught:
        runtime._pick_device(2, "nccl")
    message = str(caught.value)
    assert "LOCAL_RANK 2 needs GPU 2, but this node has 2 GPUs" in message
    assert "phalanx run -n 2" in message and "px.init(backend='gloo', device='cuda')" in message
    with pytest.raises(ValueError, match="NCCL communicates CUDA tensors only"):
        runtime._pick_device(0, "nccl", "cpu")


@pytest.mark.one_process
def test_asking_for_a_gpu_on_a_machine_without_one_is_an_error(gpus):
    gpus(0)
    with pytest.raises(ValueError, match="sees no GPU"):
        runtime._pick_device(0, "gloo", "cuda")
    with pytest.raises(ValueError, match="a device such as 'cpu', 'cuda'"):
        runtime._requested_device("gpu please")


Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    note: str


@pytest.mark.one_process
def test_inputs_anywhere_in_the_arguments_reach_the_device():
    inputs = ((torch.ones(2), [torch.zeros(3), 7]),
              {"pair": Pair(torch.ones(1), "x"), "batch": Batch(torch.arange(4), "keep")})
    moved = to_device(inputs, torch.device("meta"))
    (first, (second, seven)), rest = moved
    assert first.is_meta and second.is_meta and seven == 7
    assert isinstance(rest["pair"], Pair) and rest["pair"].a.is_meta and rest["pair"].b == "x"
    assert isinstance(rest["batch"], Batch) and rest["batch"].tokens.is_meta
    assert rest["batch"].note == "keep"


def _nested_collate(made):
    """A collate_fn whose batches nest tensors in a dict, a tuple, a list, a namedtuple and a
    dataclass, beside values that are not tensors; each batch it makes is kept in `made`."""
    def collate(samples):
        x = torch.tensor(samples, dtype=torch.float32)
        batch = {"x": x, "parts": (2 * x, [torch.zeros(2), 7, "tag"]),
                 "pair": Pair(x.long(), "p"), "batch": Batch(x[:, None], "keep")}
        made.append(batch)
        return batch
    return collate


def _tensors_in(batch):
    return [batch["x"], batch["parts"][0], batch["parts"][1][0], batch["pair"].a,
            batch["batch"].tokens]


@pytest.mark.one_process
def test_px_data_loader_gives_batches_on_the_ranks_device(monkeypatch):
    """On a GPU the targets a loop uses outside the model (`F.cross_entropy(model(x), y)`) must
    be on the model's device too: the loader moves every tensor of a batch to px.device().
    The meta device stands in for the GPU; device_placement=False leaves batches on the CPU."""
    made = []
    collate = _nested_collate(made)
    monkeypatch.setattr(runtime, "device", lambda: torch.device("meta"))
    placed = list(px.data_loader(list(range(10)), 4, shuffle=False, collate_fn=collate))
    kept = list(px.data_loader(list(range(10)), 4, shuffle=False, collate_fn=collate,
                               device_placement=False))
    assert len(placed) == len(kept) == 3
    for moved, stayed in zip(placed, kept):
        assert all(t.is_meta for t in _tensors_in(moved))
        assert all(t.device.type == "cpu" for t in _tensors_in(stayed))
        assert [t.shape for t in _tensors_in(moved)] == [t.shape for t in _tensors_in(stayed)]
        assert moved["parts"][1][1:] == [7, "tag"] and isinstance(moved["parts"], tuple)
        assert isinstance(moved["pair"], Pair) and moved["pair"].b == "p"
        assert isinstance(moved["batch"], Batch) and moved["batch"].note == "keep"
    assert [b["x"].tolist() for b in kept] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.one_process
def test_px_data_loader_on_a_cpu_rank_yields_what_collate_made():
    """On the CPU nothing is moved or rebuilt: each batch is collate's own object."""
    assert runtime.device().type == "cpu"
    made = []
    got = list(px.data_loader(list(range(10)), 4, shuffle=False,
                              collate_fn=_nested_collate(made)))
    assert len(got) == len(made) == 3 and all(a is b for a, b in zip(got, made))


@pytest.mark.one_process
def test_px_spawn_never_forks_where_there_is_a_gpu(monkeypatch):
    """torch.cuda.is_available() initialises the CUDA driver, and a forked worker of such a
    process cannot use the GPU: with a GPU on the machine, workers start fresh."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert spawn_module._start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert spawn_module._start_method() == "spawn"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert spawn_module._start_method() == "spawn"


NOTEBOOK_CELL = """
import torch, phalanx as px
from phalanx.launch.spawn import run_workers
scale = 3.0
def train(x):  # defined in __main__, as in a notebook cell: not importable by a fresh process
    t = torch.tensor([x * scale + px.rank()])
    if px.world_size() > 1:
        torch.distributed.all_reduce(t)
    return t.item()
print(run_workers(train, 2, (2.0,), start_method="spawn", timeout=120))
"""


def test_fresh_workers_receive_a_function_defined_in_a_notebook_cell():
    """The function reaches workers started fresh, by value. (In a process of its own: a
    fresh start leaves multiprocessing's resource tracker running beside its parent.)"""
    done = subprocess.run([sys.executable, "-c", NOTEBOOK_CELL], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[13.0, 13.0]"  # (6 + 0) + (6 + 1)


def _net():
    f64 = torch.float64  # drawn in float64 by both builds (a cast afterwards draws otherwise)
    return nn.Sequential(nn.Linear(6, 16, dtype=f64), nn.LayerNorm(16, dtype=f64),
                         nn.Linear(16, 3, dtype=f64))


def _meta_build(strategy, precision, out):
    torch.manual_seed(1337 + px.rank())  # as nanoGPT seeds: a different seed on every rank
    # rank 0's state is the one every rank draws from: rank 0 seeded as the full build
    with torch.device("meta"):
        model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    px.export(out, model)  # the masters, gathered
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy,precision", [("ddp", "fp32"), ("zero2", "bf16"),
                                                ("zero3", "fp32")])
def test_a_meta_build_gives_every_rank_rank_zeros_values_whatever_its_seed(strategy, precision,
                                                                           tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(1337)
    full = _net()
    out = str(tmp_path / "weights.safetensors")
    states = run_ranks(_meta_build, 3, args=(strategy, precision, out), timeout=90)
    exported = load_file(out)
    for key, value in full.state_dict().items():
        assert torch.equal(exported[key], value), f"{strategy} {precision}: {key}"
    for rank, state in enumerate(states[1:], start=1):  # and the ranks hold the same model
        for key, value in states[0].items():
            assert torch.equal(state[key], value), f"{strategy} rank {rank}: {key}"


@pytest.mark.one_process
def test_the_step_report_leaves_the_users_peak_statistics_alone(monkeypatch):
    """It reset them every step, so a peak a user measured over several steps became the last
    step's."""
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: resets.append(a))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 5 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 8 * 2**20)
    clock = StepClock(px.world.runtime.default_comm(), torch.device("cuda", 0), StepCounter())
    clock.steps.tick()
    clock.step_done()
    assert resets == []
    assert (clock.last["gpu_allocated_mb"], clock.last["gpu_peak_allocated_mb"],
            clock.last["gpu_reserved_mb"]) == (3, 5, 8)


# -- outputs in the compute dtype (px.prepare(output_dtype=None)) ------------------------------
OUT_STEPS, OUT_ROWS = 6, 4  # steps; rows per rank


def _classes(world):
    g = torch.Generator().manual_seed(7)
    return torch.randn(OUT_ROWS * world, 6, generator=g), torch.randint(0, 3, (OUT_ROWS * world,),
                                                                      generator=g)


def _classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _outputs_in_bf16(strategy):
    """bf16 training with the default output dtype (fp32) and with output_dtype=None."""
    rank, world = px.rank(), px.world_size()
    x, y = _classes(world)
    mine = slice(OUT_ROWS * rank, OUT_ROWS * (rank + 1))
    runs = {}
    for name, options in (("fp32 outputs", {}), ("compute dtype", {"output_dtype": None})):
        model = _classifier()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt = px.prepare(model, opt, strategy=strategy, precision="bf16", **options)
        dtypes, losses = [], []
        for _ in range(OUT_STEPS):
            out = model(x[mine])
            loss = F.cross_entropy(out, y[mine])
            dtypes.append((out.dtype, loss.dtype))
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            dtypes.append((model(x[mine]).dtype, None))
        params = [v.double() for v in model.state_dict().values()]  # the fp32 masters
        runs[name] = dtypes, losses, params
    return runs


def _reference_float64(world):
    """One process, float64, the whole global batch: the parameters after OUT_STEPS steps."""
    model = _classifier().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _classes(world)
    for _ in range(OUT_STEPS):
        F.cross_entropy(model(x.double()), y).backward()  # equal shares: the ranks' mean
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_outputs_stay_in_bf16_with_output_dtype_none_and_training_still_works(strategy):
    """output_dtype=None keeps outputs (a language model's logits) in the compute dtype, and the
    loss computed from them still trains the model as one process does; the default gives fp32.
    Measured against the update itself: every parameter must have moved as the reference's did
    (within 10% of the update), so no gradient, or a gradient off by the world size, fails."""
    world = 2
    want = _reference_float64(world)
    start = [p.detach().double() for p in _classifier().parameters()]
    for rank, runs in enumerate(run_ranks(_outputs_in_bf16, world, args=(strategy,),
                                          timeout=120)):
        for name, dtype in (("fp32 outputs", torch.float32), ("compute dtype", torch.bfloat16)):
            dtypes, losses, params = runs[name]
            context = f"{strategy} rank {rank} {name}"
            assert dtypes == [(dtype, dtype)] * OUT_STEPS + [(dtype, None)], context
            assert losses[-1] < 0.9 * losses[0], f"{context}: losses {losses}"
            assert len(params) == len(want), context
            for i, (got, ref, init) in enumerate(zip(params, want, start)):
                update = (ref - init).abs().max().item()
                err = (got - ref).abs().max().item()
                assert err <= 0.1 * update, (
                    f"{context}: parameter {i} is {err:.2e} from one process's, whose update "
                    f"was {update:.2e}")
