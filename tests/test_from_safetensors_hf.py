"""`px.prepare(..., init=px.from_safetensors(path))` on a small Hugging Face Llama written with
`save_pretrained`, against `from_pretrained` in one process (test_from_safetensors.py has the
model of our own). Skipped where transformers is not installed (CI does not install it).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_from_safetensors import BATCH, default_dtype

import phalanx as px
from phalanx.testing import run_ranks

pytest.importorskip("transformers", reason="transformers is not installed (CI does not install "
                    "it): pip install transformers")


def _llama(meta):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         max_position_embeddings=32)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return LlamaForCausalLM(config)


def llama_tokens(world, rank):
    all_tokens = torch.arange(BATCH * 9).view(BATCH, 9) * 7 % 37
    per = BATCH // world
    return all_tokens[rank * per:(rank + 1) * per]


def llama_loss(model, batch):
    """Ours, in float64 (the model's own, with labels=, is computed in float32)."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, 37), batch[:, 1:].reshape(-1))


def llama_reference_step(model, opt, batches):
    """One step on the mean of each batch's gradient, each computed apart as a rank computes it:
    Llama's RMSNorm runs in float32 whatever the dtype, so a gradient scaled by 1/3 before it
    (one backward of the mean loss over 3 batches) differs from one scaled after (the average
    over 3 ranks) by float32 round-off; by 1/2, not at all."""
    total = None
    for batch in batches:
        opt.zero_grad()
        llama_loss(model, batch).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    for p, t in zip(model.parameters(), total):
        p.grad = t / len(batches)
    opt.step()
    opt.zero_grad()


def _llama_load(cases):
    out = []
    for directory, strategy in cases:
        with default_dtype(torch.float64):
            model = _llama(meta=True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, opt = px.prepare(model, opt, strategy=strategy,
                                    init=px.from_safetensors(directory))
            loaded = {k: v.clone() for k, v in model.state_dict().items()}
            inv_freq = px.unwrap(model).model.rotary_emb.inv_freq.clone()
            llama_loss(model, llama_tokens(px.world_size(), px.rank())).backward()
            opt.step()
            out.append((loaded, inv_freq, {k: v.clone() for k, v in model.state_dict().items()}))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_hugging_face_llama_loads_as_from_pretrained_gives_it(tmp_path, world):
    """save_pretrained's files (one, and an index of many), read at 2 ranks under zero3, ddp and
    zero2 and at 3 under zero3, against from_pretrained in one process; lm_head.weight is tied
    (not in the files) and rotary_emb.inv_freq non-persistent (computed by _init_weights)."""
    from transformers import LlamaForCausalLM

    with default_dtype(torch.float64):
        torch.manual_seed(0)
        _llama(meta=False).save_pretrained(tmp_path / "one")
        torch.manual_seed(0)
        _llama(meta=False).save_pretrained(tmp_path / "split", max_shard_size="4KB")
        reference = LlamaForCausalLM.from_pretrained(tmp_path / "one", dtype=torch.float64)
        reference.train()
        loaded = {k: v.clone() for k, v in reference.state_dict().items()}
        inv_freq = reference.model.rotary_emb.inv_freq.clone()
        llama_reference_step(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2),
                             [llama_tokens(world, r) for r in range(world)])
    assert os.path.exists(tmp_path / "split" / "model.safetensors.index.json")
    assert "lm_head.weight" not in load_file(tmp_path / "one" / "model.safetensors")
    split, one = str(tmp_path / "split"), str(tmp_path / "one")
    cases = [(split, "zero3")] + ([(one, "ddp"), (split, "zero2")] if world == 2 else [])
    for results in run_ranks(_llama_load, world, args=(cases,), timeout=300):
        for got_loaded, got_inv_freq, got_trained in results:
            assert got_loaded.keys() == loaded.keys()
            for key in loaded:
                assert torch.equal(got_loaded[key], loaded[key]), key
            assert torch.equal(got_inv_freq, inv_freq)
            for key, value in reference.state_dict().items():
                assert torch.allclose(got_trained[key], value, rtol=0, atol=1e-12), key
