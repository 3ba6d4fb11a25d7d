"""torchao's low-bit optimizers (AdamW8bit, AdamW4bit: state quantized in blocks, one scale a
block) under zero1, zero2 and zero3: every shard boundary falls on a block boundary of the
parameter it cuts, and each element's state is quantized with the same block, scale and code
as in one process ([Note: state in blocks] in engine/optim.py).

With the same batch on every rank of a world of two, the averaged gradient is each rank's own
bit for bit (g + g and a halving are exact), so the weights and the dequantized state of a
sharded run equal one process's bit for bit. At three ranks every strategy equals ddp bit for
bit. The state per rank is about 1/N of one process's; a checkpoint
resumes at another world size and strategy, quantized again; bitsandbytes' optimizers are
refused. torch.compile is off in these processes (torchao compiles its step per tensor shape,
seconds each on a CPU), so the comparisons are of the same eager arithmetic.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.engine.optim import plain
from phalanx.testing import RanksFailed, run_ranks

torchao_optim = pytest.importorskip("torchao.optim")

STRATEGIES = ("zero1", "zero2", "zero3")


@pytest.fixture(autouse=True)
def _eager(monkeypatch):
    """torchao's step is `torch.compile(single_param_adam, ...)(...)`: run it as written."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **options: fn)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # weights of 8192 and 12288 elements (quantized: >= 4096, whole blocks), biases and an
    # embedding of 3200 (kept in fp32 by torchao's own rule, in one process as here)
    return nn.Sequential(nn.Embedding(50, 64), nn.Flatten(), nn.Linear(128, 64),
                         nn.Tanh(), nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 96),
                         nn.Tanh(), nn.Linear(96, 3))


def make_optimizer(kind, model):
    cls = {"8bit": torchao_optim.AdamW8bit, "4bit": torchao_optim.AdamW4bit}[kind]
    return cls(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step, rows=4):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (rows, 2), generator=g), torch.randn(rows, 3, generator=g)


def train(kind, strategy, same_batch, steps=4):
    model = make_model()
    opt = make_optimizer(kind, model)
    if strategy is not None:
        model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=0.02)
    world, r = px.world_size(), px.rank()
    for step in range(steps):
        x, y = batch(step, 4 if same_batch else 4 * world)
        if not same_batch:
            x, y = x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = px.optimizer_state_dict(opt) if strategy is not None else opt.state_dict()
    state = {i: {k: plain(v).clone() for k, v in s.items()} for i, s in state["state"].items()}
    held = sum(_bytes(v) for s in opt.state.values() for v in s.values())
    quantized = sum(type(v) is not torch.Tensor for s in opt.state.values() for v in s.values())
    return weights, state, held, quantized


def _bytes(value) -> int:
    if type(value) is torch.Tensor:
        return value.numel() * value.element_size()
    return sum(t.numel() * t.element_size() for t in (value.codes, value.scale))


def _equal(a: dict, b: dict, context: str) -> None:
    assert a.keys() == b.keys(), context
    for k in a:
        if isinstance(a[k], dict):
            _equal(a[k], b[k], f"{context} {k}")
        else:
            assert torch.equal(a[k], b[k]), f"{context} {k}"


def _one_process(kind):
    return train(kind, None, same_batch=True)


def _sharded_same_batch(kind):
    return {s: train(kind, s, same_batch=True) for s in STRATEGIES}


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
def test_sharded_state_equals_one_process_bit_for_bit(kind):
    want = run_ranks(_one_process, 1, args=(kind,), timeout=120)[0]
    assert want[3] > 0  # some state is quantized in one process
    for rank, got in enumerate(run_ranks(_sharded_same_batch, 2, args=(kind,), timeout=180)):
        for strategy, (weights, state, held, quantized) in got.items():
            context = f"{kind} {strategy} rank {rank}"
            _equal(weights, want[0], context)
            _equal(state, want[1], context)
            assert quantized > 0, context
            assert held < 0.75 * want[2], f"{context}: {held} of {want[2]} bytes"


def _against_ddp(kind):
    # the same batch on every rank: the ranks' sum has equal terms, so its order (which a
    # ring all-reduce sets by an element's place in the bucket) cannot change it
    return {s: train(kind, s, same_batch=True) for s in ("ddp",) + STRATEGIES}


def test_every_strategy_equals_ddp_at_three_ranks():
    for rank, got in enumerate(run_ranks(_against_ddp, 3, args=("8bit",), timeout=180)):
        for strategy in STRATEGIES:
            _equal(got[strategy][0], got["ddp"][0], f"{strategy} rank {rank}")
            _equal(got[strategy][1], got["ddp"][1], f"{strategy} rank {rank}")


def _save_resume(path, phase, strategy):
    model = make_model()
    opt = make_optimizer("8bit", model)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=0.02)
    if phase == "save":
        for step in range(2):
            x, y = batch(step)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        px.save(path, model=model, optimizer=opt)
    else:
        px.load(path, model=model, optimizer=opt)
    state = px.optimizer_state_dict(opt)
    quantized = sum(type(v) is not torch.Tensor for s in opt.state.values() for v in s.values())
    return {i: {k: plain(v).clone() for k, v in s.items()} for i, s in state["state"].items()}, \
        quantized


def test_a_checkpoint_resumes_at_another_world_size_quantized_again(tmp_path):
    """A checkpoint holds the state's values (dequantized, in the parameter's shape, as every
    optimizer state is stored); the loading ranks quantize them again in their own blocks.
    A block's scale is its largest value's magnitude again, which the 8-bit map returns
    exactly for a positive largest value and to within 1% for a negative one (torchao's signed
    map is not symmetric), so the state comes back within 1% of its block's scale."""
    path = str(tmp_path / "ckpt")
    saved, _ = run_ranks(_save_resume, 2, args=(path, "save", "zero2"), timeout=120)[0]
    for state, quantized in run_ranks(_save_resume, 3, args=(path, "load", "zero3"),
                                      timeout=120):
        assert quantized > 0  # quantized again, not left in fp32
        assert state.keys() == saved.keys()
        for index, entry in saved.items():
            for key, value in entry.items():
                got = state[index][key]
                if key == "step" or value.numel() < 4096:
                    assert torch.equal(got, value), (index, key)  # kept whole, or in fp32
                    continue
                blocks = value.reshape(-1, 256).abs().amax(-1, keepdim=True)
                err = (got - value).reshape(-1, 256).abs() / blocks
                assert err.max() <= 0.01, (index, key, err.max().item())


def _bitsandbytes_like():
    module = types.ModuleType("bitsandbytes.optim.adamw")
    cls = type("AdamW8bit", (torch.optim.Optimizer,), {
        "__module__": "bitsandbytes.optim.adamw",
        "__init__": lambda self, params: torch.optim.Optimizer.__init__(self, params, {})})
    module.AdamW8bit = cls
    sys.modules.setdefault("bitsandbytes.optim.adamw", module)
    model = make_model()
    px.prepare(model, cls(model.parameters()), strategy="zero2")


def test_bitsandbytes_is_refused_naming_torchao():
    with pytest.raises(RanksFailed) as caught:
        run_ranks(_bitsandbytes_like, 2, timeout=60)
    text = str(caught.value)
    assert "2 of 2 ranks failed" in text
    assert "bitsandbytes' AdamW8bit keeps its 8-bit state in a layout of its own" in text
    assert "torchao.optim.AdamW8bit" in text
