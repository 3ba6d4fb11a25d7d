"""Fine-tuning in the plan: one precision vocabulary with px.prepare, LoRA adapters and a
trainable fraction, frozen parameters in each strategy's layout, and the FLOPs of frozen
weights. Every figure below is computed by hand from the shapes, beside the code's."""

import math

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.observe.report_cli import plan_for_run
from phalanx.spec.precisions import PRECISIONS, precision_spec
from phalanx.testing import run_ranks

# A Llama-style config small enough to count by hand: hidden 64, 2 layers, 4 heads of which 2
# key/value heads (k_proj and v_proj are 64 -> 32), a gated MLP of 128, vocabulary 100, untied.
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 100, "tie_word_embeddings": False}
# embedding 100*64; per layer: two norms 2*64, q 64*64, k and v 32*64 each, o 64*64, gate/up/down
# 128*64 each; final norm 64; head 100*64
LAYER = 2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64
BASE = 100 * 64 + 2 * LAYER + 64 + 100 * 64
# LoRA rank 4 on q_proj (A 4x64, B 64x4) and v_proj (A 4x64, B 32x4), in each of 2 layers
ADAPTERS = 2 * ((4 * 64 + 64 * 4) + (4 * 64 + 32 * 4))


@pytest.mark.one_process
def test_the_planner_and_prepare_share_one_vocabulary():
    # "bf16" is mixed precision in both: 2 + 2 + 12 bytes per parameter under ddp with AdamW
    # (the planner's "bf16" meant pure bf16, 8 bytes, before the vocabulary was shared)
    assert px.plan(params=1e9, gpus=1, precision="bf16")["ddp"].model_states_bytes == 16e9
    assert px.plan(params=1e9, gpus=1, precision="fp16")["ddp"].model_states_bytes == 16e9
    # pure bf16 has its own name, and the old spellings are aliases of the shared names
    assert px.plan(params=1e9, gpus=1, precision="bf16-true")["ddp"].model_states_bytes == 8e9
    for alias, name in (("bf16-mixed", "bf16"), ("FP16-Mixed", "fp16")):
        a = px.plan(params=1e9, gpus=2, precision=alias)
        assert a.to_dict() == px.plan(params=1e9, gpus=2, precision=name).to_dict()
        assert a.setting["precision"] == name
    # px.prepare's names are the planner's, with the same meaning
    assert set(PRECISIONS) == {"fp32", "bf16", "fp16", "bf16-true"}
    assert precision_spec("bf16").fp32_masters and precision_spec("fp16").loss_scaling
    assert not precision_spec("fp32").fp32_masters
    # bf16-true: px.prepare's too, with no master and stochastic rounding (engine/rounding.py)
    assert not precision_spec("bf16-true").fp32_masters
    assert precision_spec("bf16-true").rounding == "stochastic"
    assert precision_spec("bf16-true", planner=True).weight_bytes == 2
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        precision_spec("fp8", planner=True)


@pytest.mark.one_process
def test_phalanx_report_plans_a_run_in_the_precision_it_recorded():
    run = {"strategy": "zero2", "precision": "bf16", "world": 2, "backend": "gloo",
           "bucket_mb": 25.0, "comm_dtype": None, "trainable_params": 10**6, "optimizer": "adamw"}
    planned = plan_for_run(run)
    # bf16 mixed, zero2: 2 bytes of weights, (2 + 12) / 2 of gradients and optimizer state
    assert planned.model_states_bytes == 2 * 10**6 + 14 * 10**6 // 2


@pytest.mark.one_process
def test_lora_from_a_config_counted_by_hand():
    r = px.plan(config=TINY, gpus=2, precision="bf16", optimizer="adamw", lora_rank=4)
    assert r.model["params"] == BASE + ADAPTERS
    assert r.model["trainable_params"] == ADAPTERS
    assert r.model["finetune"]["adapter_params"] == ADAPTERS
    # frozen parameters: whole on every rank in the compute dtype under ddp/zero1/zero2, 1/N
    # under zero3; no gradient, master or optimizer state. zero3 keeps no bf16 copy of the
    # adapters' shard between uses (the fp32 master is cast at each gather). Every unit's
    # segments are even here, so the shards need no padding.
    weights = 2 * (BASE + ADAPTERS)
    expected = {"ddp": (weights, 2 * ADAPTERS, 12 * ADAPTERS),
                "zero1": (weights, 2 * ADAPTERS, 12 * ADAPTERS // 2),
                "zero2": (weights, 2 * ADAPTERS // 2, 12 * ADAPTERS // 2),
                "zero3": (2 * BASE // 2, 2 * ADAPTERS // 2, 12 * ADAPTERS // 2)}
    for name, (w, g, k) in expected.items():
        p = r[name]
        assert (p.params_bytes, p.grads_bytes, p.optimizer_bytes) == (w, g, k), name


@pytest.mark.one_process
def test_frozen_weights_cost_4_flops_per_token_and_trainable_ones_6():
    seq = 16
    full = px.plan(config=TINY, gpus=1, seq=seq)
    lora = px.plan(config=TINY, gpus=1, seq=seq, lora_rank=4)
    matmul = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64) + 100 * 64
    attention = 12 * 2 * seq * 64
    assert full.setting["flops_per_step"] == pytest.approx((6 * matmul + attention) * seq)
    assert lora.setting["flops_per_step"] == pytest.approx(
        (4 * matmul + 6 * ADAPTERS + attention) * seq)
    # a bare count: 4 per frozen parameter, 6 per trainable one
    tuned = px.plan(params=1e9, gpus=1, seq=seq, trainable=0.25)
    assert tuned.setting["flops_per_step"] == pytest.approx((4 * 0.75e9 + 6 * 0.25e9) * seq)


@pytest.mark.one_process
def test_trainable_fraction():
    r = px.plan(params=1e9, gpus=4, precision="bf16", optimizer="adamw", trainable=0.01)
    t = 10**7
    assert r["ddp"].model_states_bytes == 2 * 10**9 + 2 * t + 12 * t
    assert r["zero2"].model_states_bytes == 2 * 10**9 + (2 * t + 12 * t) // 4
    # zero3: the frozen bf16 shard, and the trainable ones' fp32 master (no bf16 copy)
    assert r["zero3"].model_states_bytes == (2 * (10**9 - t) + 2 * t + 12 * t) // 4


@pytest.mark.one_process
def test_lora_from_a_bare_count_uses_the_stand_in_shape():
    # 8e9 parameters: 34 layers ((8e9 / (12 * 128^2))^(1/3) = 34.4) of hidden
    # int(sqrt(8e9 / (12 * 34))) = 4428; q_proj and v_proj are 4428 x 4428 there
    r = px.plan(params=8e9, gpus=2, lora_rank=8)
    adapters = 34 * 2 * (8 * 4428 + 4428 * 8)
    assert r.model["trainable_params"] == adapters
    assert r.model["params"] == 8 * 10**9 + adapters
    assert any("stand-in shape of 34 layers of hidden size 4428" in n for n in r.notes)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.v_proj = nn.Linear(32, 32), nn.Linear(32, 32)
        self.o_proj = nn.Linear(32, 32)

    def forward(self, x):
        return self.o_proj(torch.tanh(self.q_proj(x)) * self.v_proj(x))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Attention() for _ in range(3))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


@pytest.mark.one_process
def test_lora_on_a_module_adapts_its_named_layers_on_the_meta_device():
    base = sum(p.numel() for p in _Net().parameters())
    module = _Net()
    r = px.plan(module, gpus=2, input_shape="32", lora_rank=2, precision="fp32")
    adapters = 3 * 2 * (2 * 32 + 32 * 2)
    assert (r.model["params"], r.model["trainable_params"]) == (base + adapters, adapters)
    assert r.model["finetune"]["adapted_layers"] == 6
    assert all(p.requires_grad and p.device.type == "cpu" for p in module.parameters())
    assert r["ddp"].params_bytes == 4 * (base + adapters)
    assert r["ddp"].grads_bytes == 4 * adapters
    # autograd keeps less for a frozen model than for one that learns everything
    full = px.plan(module, gpus=2, input_shape="32", precision="fp32")
    assert 0 < r["ddp"].activations_bytes < full["ddp"].activations_bytes
    with pytest.raises(ValueError, match=r"no such nn.Linear in the model \(its Linear layers "
                                         r"are named head, o_proj, q_proj, v_proj\)"):
        px.plan(module, gpus=2, input_shape="32", lora_rank=2, lora_targets="query,value")


@pytest.mark.one_process
@pytest.mark.parametrize("options,message", [
    ({"lora_rank": 0}, "lora_rank must be a positive integer"),
    ({"lora_rank": 8, "trainable": 0.1}, "not both"),
    ({"trainable": 1.5}, r"in \(0, 1\]"),
    ({"lora_targets": "q_proj"}, "lora_targets goes with lora_rank"),
    ({"config": TINY, "lora_rank": 4, "lora_targets": "c_attn"},
     "names a block's projections q_proj, k_proj, v_proj, o_proj, gate_proj"),
])
def test_bad_fine_tuning_options_are_one_line(options, message):
    options.setdefault("params", None if "config" in options else 1e9)
    with pytest.raises(ValueError, match=message):
        px.plan(gpus=2, **options)


class _Lora(_Net):
    """A LoRA-shaped model: frozen blocks, a trainable adapter pair beside each block's q."""

    def __init__(self):
        super().__init__()
        from phalanx.planner.finetune import add_lora
        add_lora(self, 4, ("q_proj",))


def _lora_engine_bytes(strategies, precision):
    out = []
    for strategy in strategies:
        torch.manual_seed(0)
        model = _Lora()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
        model(torch.randn(4, 32)).float().square().mean().backward()
        opt.step()
        state = sum(t.numel() * t.element_size() for s in opt.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        masters = sum(p.numel() * 4 for p in opt.state) if precision != "fp32" else 0
        weights = sum(p.numel() * p.element_size() for p in px.unwrap(model).parameters())
        out.append((state + masters, weights))
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_parameters_in_the_plan_match_the_engine(precision):
    """ddp and zero2 hold frozen parameters whole in the compute dtype and no state for them:
    the plan's weights and optimizer bytes per rank are the engine's. (zero3's sharding of
    frozen parameters is checked when the engine shards them.)"""
    strategies = ["ddp", "zero2"]
    measured = run_ranks(_lora_engine_bytes, 2, args=(strategies, precision), timeout=120)
    with torch.device("meta"):
        model = _Lora()
    r = px.plan(model, gpus=2, precision=precision, input_shape="32", backend="gloo")
    adapters = 3 * (4 * 32 + 32 * 4)
    assert r.model["trainable_params"] == adapters
    for rank_result in measured:
        for strategy, (optimizer_bytes, weight_bytes) in zip(strategies, rank_result):
            assert weight_bytes == r[strategy].params_bytes, strategy
            # shards are padded to a multiple of the world size: a few elements per unit
            assert optimizer_bytes == pytest.approx(r[strategy].optimizer_bytes, rel=1e-3)
    bytes_per = precision_spec(precision)
    assert r["ddp"].optimizer_bytes == adapters * (bytes_per.master_bytes
                                                   + 2 * bytes_per.state_bytes)
    assert math.isclose(r["ddp"].params_bytes,
                        bytes_per.weight_bytes * sum(p.numel() for p in _Lora().parameters()))
