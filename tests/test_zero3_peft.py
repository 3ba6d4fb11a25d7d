"""PEFT's own LoRA model (`get_peft_model` on a small Hugging Face Llama, adapters on q_proj and
v_proj) under every strategy and precision: in float64 it trains as one process does, zero3
holds 1/N of it (frozen weights included) between uses, and rank 0 alone writes the adapter
with `save_pretrained`, which PEFT loads back in one process. Skipped where peft or
transformers is not installed (CI installs neither); test_zero3_frozen.py covers the same
with a model of our own.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_from_safetensors import default_dtype

import phalanx as px
from phalanx.testing import engine_of, run_ranks

pytest.importorskip("transformers", reason="transformers is not installed (CI does not install "
                    "it): pip install transformers")
pytest.importorskip("peft", reason="peft is not installed (CI does not install it): pip "
                    "install peft")

from test_from_safetensors_hf import llama_loss, llama_tokens

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
STEPS = 3


def llama(dtype=torch.float64):
    """A Llama of two blocks, the same on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    with default_dtype(dtype):
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def lora_llama(dtype=torch.float64, task_type=None):
    """`llama()` with LoRA adapters of rank 4 on q_proj and v_proj, PEFT's default
    initialisation (B zero). Without a task type PEFT's model calls the Llama directly, with
    "CAUSAL_LM" through its `base_model` (whose forward calls the Llama's `forward`)."""
    from peft import LoraConfig, get_peft_model

    base = llama(dtype)
    with default_dtype(dtype):
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                target_modules=["q_proj", "v_proj"],
                                                task_type=task_type))
    model.train()
    return model


def reference_step(model, opt, batches):
    """One step on the mean of each batch's gradient, each computed apart as a rank computes it
    (see test_from_safetensors_hf.llama_reference_step: Llama's RMSNorm runs in float32)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in trained]
    for batch in batches:
        opt.zero_grad()
        llama_loss(model, batch).backward()
        for t, p in zip(total, trained):
            t += p.grad
    for p, t in zip(trained, total):
        p.grad = t / len(batches)
    opt.step()
    opt.zero_grad()


def optimizer_for(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen parameters in it too


def _steps(model, opt) -> list:
    """STEPS training steps of a prepared model; their losses."""
    losses = []
    for _ in range(STEPS):
        loss = llama_loss(model, llama_tokens(px.world_size(), px.rank()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train(strategy, precision, dtype, task_type=None):
    model = lora_llama(dtype, task_type)
    model, opt = px.prepare(model, optimizer_for(model), strategy=strategy, precision=precision)
    losses = _steps(model, opt)
    return model, {k: v.clone() for k, v in model.state_dict().items()}, losses


def _every_strategy_and_precision(directory):
    out = {}
    for strategy in STRATEGIES:
        for precision in ("fp32", "bf16", "fp16"):
            dtype = torch.float64 if precision == "fp32" else torch.float32
            model, state, losses = _train(strategy, precision, dtype)
            out[(strategy, precision)] = (state, losses)
            if (strategy, precision) == ("zero3", "fp32"):
                engine = engine_of(model)
                out["held"] = sum(t.numel() * t.element_size()
                                  for u in engine.all_units for t in u.held())
                out["mixed"] = sum(bool(u.params and u.frozen) for u in engine.units)
                px.barrier()
                if px.rank() == 0:  # alone: the peers' shards are read while they wait
                    px.unwrap(model).save_pretrained(directory)
                px.barrier()
    out["causal lm"] = _train("zero3", "fp32", torch.float64, "CAUSAL_LM")[1]
    # a base loaded in bf16 (PEFT makes the adapters fp32): one unit holds both dtypes' weights
    model = _bf16_base()
    model, opt = px.prepare(model, optimizer_for(model), strategy="zero3", precision="bf16")
    losses = _steps(model, opt)
    out["bf16 base"] = ({k: v.clone() for k, v in model.state_dict().items()}, losses,
                        sum(bool(u.params and u.frozen) for u in engine_of(model).units))
    return out


def _bf16_base():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(torch.bfloat16), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    model.train()
    return model


def test_lora_trains_under_every_strategy_and_precision_and_saves_its_adapter_alone(tmp_path):
    from peft import PeftModel

    reference = lora_llama()
    initial32 = lora_llama(torch.float32).state_dict()  # what bf16 and fp16 start from
    opt = optimizer_for(reference)
    for _ in range(STEPS):
        reference_step(reference, opt, [llama_tokens(2, r) for r in range(2)])
    want = reference.state_dict()
    model_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    adapter = {k for k, p in reference.named_parameters() if p.requires_grad}
    assert adapter and all("lora_" in k for k in adapter)
    results = run_ranks(_every_strategy_and_precision, 2, args=(str(tmp_path / "adapter"),),
                        timeout=600)
    for rank, got in enumerate(results):
        for strategy in STRATEGIES:  # float64: as one process, frozen weights untouched
            state, _ = got[(strategy, "fp32")]
            for key, value in want.items():
                assert torch.allclose(state[key], value, rtol=0, atol=1e-12), (strategy, key)
        for strategy in STRATEGIES:  # bf16 and fp16: trained, frozen weights as cast
            for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
                state, losses = got[(strategy, precision)]
                context = (strategy, precision, rank)
                assert all(torch.isfinite(torch.tensor(losses))), context
                assert losses[-1] < losses[0], (context, losses)
                for key, value in initial32.items():
                    if key in adapter:
                        assert not torch.equal(state[key], value), (context, key)
                    else:
                        assert torch.equal(state[key], value.to(dtype).float()), (context, key)
                if strategy != "ddp":  # the same training as ddp's, on other paths
                    for key in adapter:
                        ddp = got[("ddp", precision)][0][key]
                        err = (state[key] - ddp).abs().max().item()
                        assert err <= 5e-2 * ddp.abs().max().item(), (context, key, err)
        for key, value in want.items():  # PeftModelForCausalLM: the same model and training
            assert torch.allclose(got["causal lm"][key], value, rtol=0, atol=1e-12), key
        assert got["mixed"] >= 2  # a block's q/v projections with their adapters
        assert got["held"] <= model_bytes / 2 + 1024, (got["held"], model_bytes)
    base = _bf16_base().state_dict()
    for rank, got in enumerate(results):
        state, losses, mixed = got["bf16 base"]
        assert mixed >= 2 and losses[-1] < losses[0], (rank, mixed, losses)
        for key, value in base.items():
            assert state[key].dtype == value.dtype, key  # bf16 weights, fp32 adapters
            assert torch.equal(state[key], value) != (key in adapter), key
    loaded = PeftModel.from_pretrained(llama(), str(tmp_path / "adapter"))
    trained = results[0][("zero3", "fp32")][0]
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert os.path.exists(tmp_path / "adapter" / "adapter_model.safetensors")
