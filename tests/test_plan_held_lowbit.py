"""The founding example's low-bit settings, held against the plan: zero3 with bf16-true and
torchao's AdamW8bit (each rank's weight shard and 8-bit moments), and zero3 with an NF4 base
(each rank's slice of the 4-bit weights, the adapters' masters and state), the engine's bytes
counted from what it keeps, each component and the whole within 2% of `px.plan`'s.

torch.compile is off in these processes (torchao compiles its step per shape: seconds each on
a CPU); what is held does not depend on it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import phalanx as px
from phalanx.testing import engine_of, run_ranks

pytest.importorskip("torchao.optim")

D = 256  # 65536-element weights: whole blocks of 8-bit state (256) and of NF4 (64 x 256)


@pytest.fixture(autouse=True)
def _eager(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn=None, **options: fn)


def _matrices() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(D, D, bias=False) for _ in range(4)])


class _Lora(nn.Module):
    def __init__(self, r: int = 8):
        super().__init__()
        self.base = nn.Linear(D, D, bias=False).requires_grad_(False)
        self.lora_A = nn.Linear(D, r, bias=False)
        self.lora_B = nn.Linear(r, D, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def _adapted() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Lora() for _ in range(4)])


def _state_bytes(opt) -> int:
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if type(v) is torch.Tensor:
                total += v.numel() * v.element_size() if v.dim() else 0
            elif isinstance(v, torch.Tensor):  # torchao's quantized state
                total += sum(t.numel() * t.element_size() for t in (v.codes, v.scale))
    return total


def _held(case):
    from torchao.optim import AdamW8bit
    if case == "8bit":
        model = _matrices()
        opt = AdamW8bit(model.parameters(), lr=1e-3)
        model, opt = px.prepare(model, opt, strategy="zero3", precision="bf16-true",
                                step_in_backward=True)
    else:
        model = _adapted()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model, opt = px.prepare(model, opt, strategy="zero3", precision="bf16",
                                base_dtype="nf4")
    for _ in range(2):
        model(torch.randn(4, D)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    engine = engine_of(model)
    weights = sum(u.master.numel() * u.master.element_size() for u in engine.units)
    weights += sum(u.frozen_shard.numel() * u.frozen_shard.element_size()
                   for u in engine.all_units if u.frozen_shard is not None)
    nf4 = sum(m._phalanx_nf4.nbytes() for m in px.unwrap(model).modules()
              if hasattr(m, "_phalanx_nf4"))
    pool = sum(t.numel() * t.element_size() for t in engine.pool.tensors()) \
        if engine.pool is not None else 0
    return weights, nf4, _state_bytes(opt), pool


@pytest.mark.parametrize("case", ["8bit", "nf4"])
def test_what_the_engine_holds_is_the_plan(case):
    measured = run_ranks(_held, 2, args=(case,), timeout=180)
    with torch.device("meta"):
        model = _matrices() if case == "8bit" else _adapted()
    if case == "8bit":
        plan = px.plan(model, gpus=2, precision="bf16-true", optimizer="adamw8bit",
                       step_in_backward=True, strategy="zero3", input_shape=str(D),
                       backend="gloo")["zero3"]
    else:
        plan = px.plan(model, gpus=2, precision="bf16", base_dtype="nf4", strategy="zero3",
                       input_shape=str(D), backend="gloo")["zero3"]
    # between steps no gradient is kept (the step in backward; an NF4 base's adapters are
    # stepped as their step comes): the weights, the optimizer and the kept buffers
    planned = (plan.params_bytes + plan.optimizer_bytes + plan.buffers_detail["grad_pool"]
               + plan.buffers_detail["comm_buffers"])
    for weights, nf4, state, pool in measured:
        held = weights + nf4 + state + pool
        said = (f"{case}: weights and masters {weights} B, NF4 {nf4} B, state {state} B, pool "
                f"{pool} B: {held} B; planned {planned} B (weights {plan.params_bytes}, "
                f"optimizer {plan.optimizer_bytes})")
        assert held == pytest.approx(planned, rel=0.02), said
        if case == "8bit":  # bf16 shards as their own masters; 8-bit moments and their scales
            assert weights == pytest.approx(plan.params_bytes, rel=0.02), said
            assert state == pytest.approx(plan.optimizer_bytes, rel=0.02), said
        else:  # the 4-bit base; the adapters' fp32 masters and moments
            assert nf4 == pytest.approx(plan.params_bytes, rel=0.02), said
            assert weights + state == pytest.approx(plan.optimizer_bytes, rel=0.02), said
