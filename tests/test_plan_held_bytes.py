"""What the engine holds between steps, found by walking it, against the plan: zero3 with
frozen parameters laid out in the units of the trainable ones (a LoRA-shaped model), and
offload's host side (masters, optimizer state and the step's host buffers)."""

import pytest
import torch
from test_plan_finetune import _Attention, _Lora
from test_plan_memory import _storage_bytes, _tensors_reachable

import phalanx as px
from phalanx.engine.zero3_roots import engine_roots
from phalanx.planner.finetune import add_lora
from phalanx.testing import engine_of, run_ranks

BUCKET_MB = 0.01  # several units, and several runs of units in the host step
CASES = [("zero3", None), ("zero3", "optimizer"), ("zero3", "params"), ("zero2", "optimizer")]


def _held_bytes(precision):
    """Bytes of every storage reachable from the prepared model and optimizer after a few
    steps (the engine's, on the device and on the host alike: on a CPU both are here)."""
    out, roots = [], None
    for strategy, offload in CASES:
        torch.manual_seed(0)
        model = _Lora()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model, opt = px.prepare(model, opt, strategy=strategy, precision=precision,
                                bucket_mb=BUCKET_MB, offload=offload)
        for _ in range(2):
            model(torch.randn(4, 32)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        # the walk stops at the test's own classes: their parameters are given to it
        module = list(px.unwrap(model).parameters())
        out.append(sum(_storage_bytes(_tensors_reachable(model, opt, module)).values()))
        roots = roots or engine_roots(engine_of(model))
    return out, roots


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_frozen_shards_and_offload_host_memory_are_the_engines(precision):
    measured = run_ranks(_held_bytes, 2, args=(precision,), timeout=120)
    with torch.device("meta"):
        model = _Lora()
    plans = {offload: px.plan(model, gpus=2, precision=precision, input_shape="32",
                              backend="gloo", bucket_mb=BUCKET_MB, offload=offload)
             for offload in {o for _, o in CASES}}
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    for rank_result, roots in measured:
        # what run.json records of zero3's gathers counts the frozen members of each unit
        assert sum(n for _, n in roots["roots"]) == sum(p.numel() for p in model.parameters())
        for (strategy, offload), held in zip(CASES, rank_result):
            plan = plans[offload][strategy]
            planned = (plan.model_states_bytes + plan.buffers_detail["grad_pool"]
                       + plan.buffers_detail["comm_buffers"] + plan.host_bytes)
            # the first rank's shards (the most padded) and the used-flags: a few elements
            assert held == pytest.approx(planned, rel=5e-3), (strategy, offload)
            if offload is not None:  # the host side is more than the tolerance
                assert plan.host_bytes > 0.05 * planned
    # zero3's weights between uses: half the frozen parameters in the compute dtype (padded),
    # and under fp32 the trainable ones' shards (their own masters)
    bytes_ = 4 if precision == "fp32" else 2
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    held = frozen if precision == "bf16" else frozen + trainable
    assert bytes_ * held / 2 <= plans[None]["zero3"].params_bytes < bytes_ * held * 0.51


class _Stemmed(torch.nn.Module):
    """A LoRA-shaped model with a frozen layer first (as a LoRA model's embedding is): its
    output needs no gradient, so zero3's backward never gathers it again."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(32, 32)
        self.layers = torch.nn.ModuleList(_Attention() for _ in range(3))
        self.head = torch.nn.Linear(32, 4)
        add_lora(self, 4, ("q_proj",))  # everything frozen but the adapters

    def forward(self, x):
        x = torch.tanh(self.stem(x))
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _zero3_payload(precision, steps=2):
    from phalanx.comm import records

    torch.manual_seed(0)
    model = _Stemmed()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = px.prepare(model, opt, strategy="zero3", precision=precision)
    for step in range(steps + 1):
        if step == 1:  # the first step re-lays the buckets: not a steady-state step
            records.reset_counts()
        model(torch.randn(4, 32)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {op: b / steps for op, b in records.bytes_by_kind().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_gathers_of_a_frozen_stem_are_planned_as_the_engine_makes_them(precision):
    counted = run_ranks(_zero3_payload, 2, args=(precision,), timeout=120)[0]
    with torch.device("meta"):
        model = _Stemmed()
    planned = px.plan(model, gpus=2, precision=precision, strategy="zero3", backend="gloo",
                      input_shape="32")["zero3"].comm_payload_bytes
    assert set(counted) == set(planned)
    for op in planned:  # padding to the world size and the units' flags: a few elements each
        assert counted[op] == pytest.approx(planned[op], rel=2e-3, abs=64), op
