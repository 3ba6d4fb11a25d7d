"""zero3 from a config: what stays gathered from forward into backward (the embedding, the head)
is planned as for the module the config describes.

Three descriptions of one model, each planned by `px.plan`: its Hugging Face style config; the
planner's own reference model built from that config on the meta device (`ReferenceTransformer`,
whose parameters are the config's, in the config's order); and a Llama written as Hugging Face's
`LlamaForCausalLM` is laid out (`model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`),
built by hand so that no optional package is needed. A Llama-3.1-8B shape (hidden 4096, MLP
14336, 32 layers, 32 heads of which 8 key/value heads, vocabulary 128256, untied embeddings)
and a small one, at 2 and 8 ranks, trained in full, with LoRA adapters and with a trainable
fraction: every strategy's memory rows agree between the three, and so does the total those rows
make with the config's activations (a module's are traced, a config's are a formula's); the
communication agrees with the reference model's (the module the benchmarks train from a config).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.planner.layout import zero3_roots
from phalanx.planner.memory import peak_bytes
from phalanx.planner.model_desc import describe
from phalanx.planner.reference_model import ReferenceTransformer
from phalanx.planner.transformer import shape_from_config

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072,
            "tie_word_embeddings": False}
# embedding and head (102k elements each) larger than a layer (86k): the largest roots
SMALL = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 96,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 800, "tie_word_embeddings": False}
# the same with the head tied to the embedding: one unit rooted at the model itself
SMALL_TIED = dict(SMALL, tie_word_embeddings=True)

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
# LoRA's targets as the config names them, and as the reference model does
LORA = {"lora_rank": 16}
REFERENCE_TARGETS = ("attn.q", "attn.v")


class _RMSNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.heads, self.kv = c["hidden_size"], c["num_attention_heads"], \
            c["num_key_value_heads"]
        kv_width = h // self.heads * self.kv
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv_width, bias=False)
        self.v_proj = nn.Linear(h, kv_width, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x):
        b, t, h = x.shape
        q = self.q_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h))


class _MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = _RMSNorm(c["hidden_size"])
        self.post_attention_layernorm = _RMSNorm(c["hidden_size"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = _RMSNorm(c["hidden_size"])

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class _LlamaForCausalLM(nn.Module):
    """Hugging Face's Llama as its modules are named and nested (the forward is plain)."""

    def __init__(self, c):
        super().__init__()
        self.model = _Model(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids):
        return self.lm_head(self.model(ids))

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head


def _described(config):
    """The three descriptions of `config`'s model: px.plan's arguments for each."""
    with torch.device("meta"):
        reference = ReferenceTransformer(shape_from_config(config), dropout=0.0)
        llama = _LlamaForCausalLM(config)
    return {"config": {"config": config}, "reference": {"model": reference},
            "llama": {"model": llama}}


def _plans(config, world, finetune=None):
    out = {}
    for route, model in _described(config).items():
        options = dict(finetune or {})
        if route == "reference" and "lora_rank" in options:
            options["lora_targets"] = REFERENCE_TARGETS
        out[route] = px.plan(**model, gpus=world, seq=256, **options)
    return out


def _rows(p) -> dict:
    """A strategy's memory per device, activations apart (a config's are the formula's, a
    module's traced)."""
    return {"parameters": p.params_bytes, "gradients": p.grads_bytes,
            "optimizer state": p.optimizer_bytes, "step working memory": p.step_working_bytes,
            **p.buffers_detail}


def _agree(config, module, what, rel=1e-3):
    """`config`'s plan of a strategy against `module`'s: each row, and the total the module's
    rows make with the config's activations (the peak: memory.py's [Note: Peak])."""
    for row, value in _rows(module).items():
        assert _rows(config)[row] == pytest.approx(value, rel=rel, abs=4096), (what, row)
    total, _ = peak_bytes(module.model_states_bytes, module.buffers_detail,
                          config.activations_bytes, module.step_working_bytes)
    assert config.total_bytes == pytest.approx(total, rel=rel), what


@pytest.mark.one_process
@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("config", [SMALL, SMALL_TIED, LLAMA_8B], ids=["small", "tied", "8b"])
def test_zero3_from_a_config_gathers_what_the_module_does(config, world):
    plans = _plans(config, world)
    zero3 = {route: plan["zero3"] for route, plan in plans.items()}
    gathered = {route: p.buffers_detail["gathered_params"] for route, p in zero3.items()}
    # the embedding and the head are roots as large as the largest block, or larger: each is
    # gathered beside the root that runs next to it (the first block, the last block or the
    # final norm), never the two together
    # (the small config's head shares its unit with the final norm: rooted at the model,
    # gathered through the forward besides)
    shape = shape_from_config(config)
    vocab = shape.vocab * shape.hidden
    model_rooted, roots, _ = zero3_roots(describe(config=config), 2)
    if config is not SMALL_TIED:
        assert gathered["reference"] == 2 * (model_rooted + vocab + shape.layer_params())
    if config is LLAMA_8B:  # 525M-parameter embedding and head, 218M-parameter blocks: 1.49 GB
        assert (vocab, shape.layer_params()) == (525_336_576, 218_112_000)
        assert gathered["config"] == 2 * (525_336_576 + 218_112_000)
    # kept into backward: the head, the root the forward ends with, or rooted at the model
    # itself where it is tied to the embedding or shares a unit with the final norm
    kept = model_rooted or next(iter(roots.values()))
    assert shape.vocab * shape.hidden <= kept <= shape.vocab * shape.hidden + 2 * shape.hidden
    assert gathered["config"] == gathered["reference"] == pytest.approx(gathered["llama"],
                                                                        rel=1e-3)
    for route in ("reference", "llama"):
        _agree(zero3["config"], zero3[route], route)
    # backward does not gather again the root the forward ended with (the head)
    assert zero3["config"].comm_bytes_per_step == zero3["reference"].comm_bytes_per_step
    assert zero3["config"].comm_bytes_per_step == pytest.approx(
        zero3["llama"].comm_bytes_per_step, rel=1e-4)


@pytest.mark.one_process
@pytest.mark.parametrize("finetune", [None, LORA, {"trainable": 0.1}],
                         ids=["full", "lora", "trainable"])
@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("config", [SMALL, LLAMA_8B], ids=["small", "8b"])
def test_every_strategy_from_a_config_as_from_the_module(config, world, finetune):
    plans = _plans(config, world, finetune)
    for strategy in STRATEGIES:
        of = {route: plan[strategy] for route, plan in plans.items()}
        for route in ("reference", "llama"):
            _agree(of["config"], of[route], (route, strategy))
        assert of["config"].comm_bytes_per_step == pytest.approx(
            of["reference"].comm_bytes_per_step, rel=1e-4), strategy
