"""Activation memory and FLOPs: the formula and the meta-device trace against a measured CPU
forward/backward of a model built from the same config."""

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import phalanx as px
from phalanx.planner.reference_model import ReferenceTransformer
from phalanx.planner.trace import trace_module
from phalanx.planner.transformer import TransformerShape, shape_from_config

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)

GPT2_LIKE = {"model_type": "gpt2", "n_embd": 64, "n_layer": 3, "n_head": 4, "n_inner": None,
             "n_positions": 64, "vocab_size": 211, "attn_pdrop": 0.1, "resid_pdrop": 0.1,
             "embd_pdrop": 0.1}
LLAMA_LIKE = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 172,
              "vocab_size": 97, "hidden_act": "silu", "tie_word_embeddings": False,
              "max_position_embeddings": 4096, "rope_theta": 10000.0}


def measure_saved_bytes(model, ids, targets):
    """Bytes autograd saves for backward in a real forward: unique storages, parameters left out."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen, keep = {}, []

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params and s._cdata not in seen:
            seen[s._cdata] = s.nbytes()
            keep.append(s)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(ids, targets)
    loss.backward()  # the saved tensors really were what backward needed
    return sum(seen.values())


def _build(config, dtype, attention="eager"):
    torch.manual_seed(0)
    shape = shape_from_config(config)
    model = ReferenceTransformer(shape, attention=attention).to(dtype)
    return shape, model


def _batch(shape, b, s):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, shape.vocab, (b, s), generator=g),
            torch.randint(0, shape.vocab, (b, s), generator=g))


def test_config_parameters_equal_the_built_model():
    for config in (GPT2_LIKE, LLAMA_LIKE):
        shape, model = _build(config, torch.float32)
        assert shape.params() == sum(p.numel() for p in model.parameters())


def test_gpt2_small_config_has_its_published_parameter_count():
    config = dict(GPT2_LIKE, n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)
    assert shape_from_config(config).params() == 124_439_808


def test_korthikanti_per_layer_formula_is_the_special_case():
    # I = 4h, dropout on, 1-byte masks, 16-bit: s*b*h*(34 + 5*a*s/h), plus two fp32 norm stats.
    s = TransformerShape(hidden=1024, layers=1, heads=16, vocab=1000, intermediate=4096,
                         kv_heads=16, attn_dropout=True, hidden_dropout=True)
    b, seq, h, a = 2, 512, 1024, 16
    expected = seq * b * h * (34 + 5 * a * seq / h) + 16 * seq * b
    assert s.layer_activation_bytes(b, seq, elem=2) == expected
    with_ckpt = s.activation_bytes(b, seq, 2, checkpointing=True)
    assert with_ckpt - s.outer_activation_bytes(b, seq, 2) == 2 * seq * b * h + expected


@pytest.mark.parametrize("config", [GPT2_LIKE, LLAMA_LIKE], ids=["gpt2-like", "llama-like"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formula_matches_a_measured_forward_backward(config, dtype):
    shape, model = _build(config, dtype)
    b, s = 2, 48
    measured = measure_saved_bytes(model, *_batch(shape, b, s))
    e = torch.empty((), dtype=dtype).element_size()
    # On CPU a dropout mask is kept in the activation's dtype (CUDA keeps 1-byte masks).
    predicted = shape.activation_bytes(b, s, e, mask_bytes=e)
    assert predicted == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("config", [GPT2_LIKE, LLAMA_LIKE], ids=["gpt2-like", "llama-like"])
def test_flash_formula_matches_a_measured_sdpa_forward_backward(config):
    # scaled_dot_product_attention keeps no s x s matrix (attention dropout off: the CPU kernel
    # takes no dropout).
    shape, model = _build(dict(config, attn_pdrop=0.0), torch.float32, attention="sdpa")
    b, s = 2, 48
    measured = measure_saved_bytes(model, *_batch(shape, b, s))
    predicted = shape.activation_bytes(b, s, 4, attention="flash", mask_bytes=4)
    assert predicted == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("config", [GPT2_LIKE, LLAMA_LIKE], ids=["gpt2-like", "llama-like"])
def test_meta_trace_matches_a_measured_forward_backward(config):
    shape, model = _build(config, torch.float32)
    b, s = 2, 40
    measured = measure_saved_bytes(model, *_batch(shape, b, s))
    traced = trace_module(model, (torch.zeros(b, s, dtype=torch.long),), torch.float32)
    # The trace assumes the loss saves one fp32 tensor of the output's size, as cross-entropy's
    # log-softmax does; the measured loss also keeps its int64 targets.
    assert traced.activation_bytes + 8 * b * s == pytest.approx(measured, rel=0.01)
    assert traced.blocks == shape.layers


def test_meta_trace_allocates_nothing_and_agrees_with_the_formula_at_scale():
    # GPT-2 small shape at batch 8 x 1024: gigabytes of activations, traced without memory.
    config = dict(GPT2_LIKE, n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)
    shape = shape_from_config(config)
    with torch.device("meta"):
        model = ReferenceTransformer(shape)
    traced = trace_module(model, (torch.zeros(8, 1024, dtype=torch.long, device="meta"),),
                          torch.bfloat16)
    formula = shape.activation_bytes(8, 1024, 2, mask_bytes=2)
    assert traced.activation_bytes == pytest.approx(formula, rel=0.01)
    ckpt = shape.activation_bytes(8, 1024, 2, checkpointing=True, mask_bytes=2)
    assert traced.checkpointed_bytes == pytest.approx(ckpt, rel=0.02)
    # FLOPs: 3 x forward by the counter == 6 x matmul parameters + 12 L s h, per token
    assert 3 * traced.forward_flops == pytest.approx(shape.flops_per_token(1024) * 8 * 1024,
                                                     rel=1e-6)


def test_plan_uses_the_formula_for_configs_and_the_trace_for_modules():
    shape, model = _build(GPT2_LIKE, torch.float32)
    by_config = px.plan(config=GPT2_LIKE, gpus=2, precision="fp32", batch=2, seq=32)
    by_module = px.plan(model, gpus=2, precision="fp32", batch=2, seq=32)
    assert by_config["ddp"].params_bytes == by_module["ddp"].params_bytes
    # the module trace sees CPU/meta dropout masks in fp32; the formula assumes 1-byte masks
    act_config = by_config["ddp"].activations_bytes
    transient = shape.loss_transient_bytes(2, 32)
    assert act_config == shape.activation_bytes(2, 32, 4) + transient
    assert by_module["ddp"].activations_bytes == pytest.approx(
        shape.activation_bytes(2, 32, 4, mask_bytes=4) - 8 * 2 * 32 + transient, rel=0.01)
    ckpt = px.plan(config=GPT2_LIKE, gpus=2, precision="fp32", batch=2, seq=32,
                   activation_checkpointing=True)
    assert ckpt["ddp"].activations_bytes < act_config
