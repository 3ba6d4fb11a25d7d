"""A fine-tuned model leaves phalanx as Hugging Face loads it: `px.export` into the directory
`config.save_pretrained` wrote gives a checkpoint `from_pretrained` loads, equal to the trained
model (docs/guides/fine-tuning.md, "Exporting for from_pretrained"). A small Llama with tied
embeddings, loaded with `px.from_safetensors` from a meta build under zero3 at 2 ranks, one
AdamW step in float64. Skipped where transformers is not installed (CI does not install it)."""

from __future__ import annotations

import os

import pytest
import torch
from test_from_safetensors import default_dtype
from test_from_safetensors_hf import _llama, llama_loss, llama_tokens

import phalanx as px
from phalanx.testing import run_ranks

pytest.importorskip("transformers", reason="transformers is not installed (CI does not install "
                    "it): pip install transformers")


def _fine_tune_and_export(pretrained, out, precision):
    with default_dtype(torch.float64):
        model = _llama(meta=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = px.prepare(model, opt, strategy="zero3", precision=precision,
                                init=px.from_safetensors(pretrained))
        llama_loss(model, llama_tokens(px.world_size(), px.rank())).backward()
        opt.step()
        os.makedirs(out, exist_ok=True)
        if px.is_main():
            px.unwrap(model).config.save_pretrained(out)
        px.export(os.path.join(out, "model.safetensors"), model)
        return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_exported_zero3_model_loads_with_from_pretrained(tmp_path, precision):
    from transformers import AutoModelForCausalLM

    with default_dtype(torch.float64):
        _llama(meta=False).save_pretrained(tmp_path / "pretrained")
        before = AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained").state_dict()
    out = str(tmp_path / "finetuned")
    trained = run_ranks(_fine_tune_and_export, 2,
                        args=(str(tmp_path / "pretrained"), out, precision), timeout=180)[0]
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    state = loaded.state_dict()
    assert state.keys() == trained.keys()
    for name, value in trained.items():  # the masters, whole: bit for bit
        assert torch.equal(state[name], value), name
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert max(float((state[k] - before[k]).abs().max()) for k in before) > 1e-3  # it trained
