"""What the engine holds between steps, found by walking it, against the plan: zero3 with
frozen parameters laid out in the units of the trainable ones (a LoRA-shaped model),
offload's host side (masters, optimizer state and the step's host buffers), and the step in
backward (no gradient shard kept between steps; during backward, the shards held at once
against the plan's two units' worth, watched at each unit's step)."""

import pytest
import torch
from test_plan_finetune import _Attention, _Lora, _Net
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
            if offload is not None:  # the gradient shards went to the host as they were made
                planned -= plan.grads_bytes  # (in host_bytes): the device's two units' are gone
            # the first rank's shards (the most padded) and the used-flags: a few elements
            assert held == pytest.approx(planned, rel=5e-3), (strategy, offload, held, planned)
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


IN_BACKWARD_MB = 0.004  # a unit per linear layer or two: two units are a small part of all


def _held_in_backward(strategy, precision):
    """With step_in_backward=True: every storage reachable between steps, and, at each unit's
    step in backward, the bytes of the reduced gradient shards the units hold at that moment
    (the most over the steps), and the largest one unit holds."""
    from phalanx.engine import stepping

    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision,
                            bucket_mb=IN_BACKWARD_MB, step_in_backward=True)
    engine = engine_of(model)
    seen = {"most": 0, "one": 0}
    original = stepping.Stepper.step_now

    def counting(self, unit, step_one, comm):
        shards = {u.grad_shard.untyped_storage().data_ptr(): u.grad_shard.nbytes
                  for u in engine.units if u.grad_shard is not None}
        seen["most"] = max(seen["most"], sum(shards.values()))
        seen["one"] = max(seen["one"], max(shards.values(), default=0))
        return original(self, unit, step_one, comm)

    stepping.Stepper.step_now = counting
    try:
        for _ in range(3):
            model(torch.randn(4, 32)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        stepping.Stepper.step_now = original
    module = list(px.unwrap(model).parameters())
    held = sum(_storage_bytes(_tensors_reachable(model, opt, module)).values())
    return held, seen["most"], seen["one"], len(engine.units)


def planned_held(plan):
    """What the plan says a rank keeps between steps when no gradient outlives its step."""
    return (plan.params_bytes + plan.optimizer_bytes + plan.buffers_detail["grad_pool"]
            + plan.buffers_detail["comm_buffers"])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-true"])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_the_step_in_backward_holds_what_the_plan_says(strategy, precision):
    """step_in_backward=True: no gradient shard is kept between steps, so what the engine holds
    then is the plan's weights, optimizer state and kept buffers; during backward, the shards
    held at once are at most the plan's gradients (two consecutive units' shards: the unit
    stepping and the one reduced meanwhile), at least the largest unit's."""
    measured = run_ranks(_held_in_backward, 2, args=(strategy, precision), timeout=120)
    with torch.device("meta"):
        model = _Net()
    options = dict(gpus=2, precision=precision, input_shape="32", backend="gloo",
                   bucket_mb=IN_BACKWARD_MB, strategy=strategy)
    plan = px.plan(model, step_in_backward=True, **options)[strategy]
    ordinary = px.plan(model, **options)[strategy]
    for held, most, one, units in measured:
        said = (f"{strategy} {precision}: held {held} B between steps, planned "
                f"{planned_held(plan)} B; gradient shards {one} B (one unit) to {most} B at "
                f"once in backward, planned {plan.grads_bytes} B (the ordinary step keeps "
                f"{ordinary.grads_bytes} B)")
        assert units > 5, said  # several units, so that two of them are not all of them
        # the first rank's shards (the most padded), the used-flags and the signal: a few
        # elements per unit, of units of a few hundred (about 0.5%)
        assert held == pytest.approx(planned_held(plan), rel=1e-2), said
        assert one <= most <= plan.grads_bytes, said
        # two units' shards, not the whole shard the ordinary step keeps
        assert plan.grads_bytes < 0.5 * ordinary.grads_bytes, said
        assert plan.grads_bytes <= 2 * one + 2 * 2 * 4, said  # padding: a few elements a unit
