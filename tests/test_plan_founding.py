"""The founding example in the plan: Llama 3.1 8B on two RTX 3090s (24 GB each), 2048 tokens a
card, micro-batch 1, flash attention and activation checkpointing, under zero3, the loss
computed by px.linear_cross_entropy (sliced_loss). Each recipe's bytes per card are computed
here by hand from the config's shapes, beside the plan's, and the figures are in every
assertion's message:

    full fine-tune, no offload   precision="bf16-true", optimizer="adamw8bit", step_in_backward
    full fine-tune, offloaded    the same precision and optimizer, offload="params" (and
                                 offload="optimizer", which keeps the weight shard on the card)
    LoRA                         rank 8 on q_proj and v_proj over the bf16 base
    QLoRA                        the same adapters over a base stored 4-bit (base_dtype="nf4")

The targets are 20 GiB (full, no offload), 10 GiB and 64 GB of host memory (offload), 10 GiB
(LoRA) and 5 GiB (QLoRA) per card; each recipe meets its own. What decides them, pinned below:
the loss computed a slice of the vocabulary at a time holds one fp32 log-sum-exp per token and
one slice's working memory (0.14 GiB) where F.cross_entropy over the logits holds 12 bytes per
token per vocabulary entry (2.94 GiB at 2048 tokens); zero3 gathers the 525M-element head or
embedding beside the block next to it (never the two together), and holds the gradients of two
consecutive units in flight."""

import json
import math

import pytest

import phalanx as px
from phalanx.cli import main as phalanx_main
from phalanx.engine.flat import PIECE_CAP
from phalanx.model.spec import Spec
from phalanx.planner.memory import NF4_BYTES, QUANTIZED_STATES

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)

LLAMA_3_1_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8,
                "tie_word_embeddings": False, "max_position_embeddings": 131072}
FOUNDING = dict(config=LLAMA_3_1_8B, gpus=2, gpu="rtx3090", seq=2048, batch=1,
                attention="flash", activation_checkpointing=True, strategy="zero3")
LEAN = dict(precision="bf16-true", optimizer="adamw8bit")
GiB = 2**30

V, H, INNER, LAYERS, KV = 128256, 4096, 14336, 32, 1024
EMBEDDING = V * H                               # and the untied head: 525,336,576 each
LINEAR = 2 * H * H + 2 * KV * H + 3 * INNER * H  # a block's q, o, k, v, gate, up, down
PARAMS = 2 * EMBEDDING + LAYERS * (LINEAR + 2 * H) + H  # 8,030,261,248
EIGHT_BIT = 2 * (1 + 4 / 256)                   # AdamW8bit's two moments, bytes per parameter
LOSS = 12 * V * 2048                            # fp32 log-softmax and its gradients, 2048 tokens
LAYER = LINEAR + 2 * H                          # a block's projections and two norms
SLICED = dict(sliced_loss=True)
SLICED_LOSS = 4 * 2048 + 6 * 2048 * (8192 + H)  # its log-sum-exp; a slice at backward


def _plan(**options):
    return px.plan(**{**FOUNDING, **SLICED, **options})


def _said(p) -> str:
    parts = ("params", "grads", "optimizer", "activations", "buffers", "step_working", "total")
    return (", ".join(f"{k} {getattr(p, k + '_bytes') / GiB:.2f}" for k in parts)
            + f" GiB per card (peak at {p.peak_at})"
            + (f", {p.host_bytes_per_node / 1e9:.1f} GB of host memory" if p.host_bytes_per_node
               else ""))


def test_the_founding_model_is_llama_3_1_8b():
    r = _plan()
    assert r.model["params"] == PARAMS == 8_030_261_248
    assert r.setting["seq"] == 2048 and r.setting["gpu_memory_bytes"] == 24e9
    assert r.setting["sliced_loss"] is True


def _backward_start(p) -> int:
    """The peak at the start of backward: the model states, the kept pool, the activations (the
    loss's included), the gradient being staged, zero3's gathered roots and the gradients in
    flight."""
    b = p.buffers_detail
    return (p.params_bytes + p.grads_bytes + p.optimizer_bytes + b["grad_pool"]
            + p.activations_bytes + b["grad_staging"] + b["gathered_params"] + b["unit_grads"]
            + b["dequantized"])


def test_a_full_fine_tune_without_offload():
    """bf16 weights that are their own masters (2 bytes), AdamW's moments 8-bit (2.03 bytes),
    each unit stepped as soon as its gradient is reduced (two consecutive units' gradient
    shards: the embedding's and, made just before it, the first block's q_proj), all halved by
    zero3. The step, in backward, upcasts a piece of at most 2^22 elements at a time (engine/
    flat.py's cap) as fp32 weights, gradients and two moments, 16 bytes each: 64 MiB. zero3
    gathers the embedding beside the first block (or the head beside the last), and holds the
    embedding's and q_proj's gradients in flight; k_proj's and v_proj's share a unit, so the
    larger is staged before its copy into the pool. The peak is the start of backward: 19.01
    GiB, 20.4 GB, within the 20 GiB target, with the headroom's 10% of 24 GB to spare."""
    p = _plan(**LEAN, step_in_backward=True)["zero3"]
    said = _said(p)
    b = p.buffers_detail
    assert p.params_bytes == 2 * PARAMS // 2, said
    assert p.optimizer_bytes == EIGHT_BIT * PARAMS / 2, said
    assert p.grads_bytes == 2 * (EMBEDDING // 2 + H * H // 2), said
    assert p.step_working_bytes == 16 * PIECE_CAP, said
    assert b["gathered_params"] == 2 * (EMBEDDING + LAYER), said
    assert b["unit_grads"] == 2 * (EMBEDDING + H * H), said
    assert b["grad_staging"] == 2 * KV * H, said
    assert p.peak_at == "backward start" and p.total_bytes == _backward_start(p), said
    assert p.total_bytes <= 20 * GiB and round(p.total_bytes / GiB, 2) == 19.01, said
    assert p.fits_with_headroom, said
    # the loss: 4 bytes a token kept, one slice of 8192 rows at the start of backward
    plain = px.plan(**FOUNDING, **LEAN, step_in_backward=True)["zero3"]
    assert plain.activations_bytes - p.activations_bytes == LOSS - SLICED_LOSS, _said(plain)
    assert round(LOSS / GiB, 2) == 2.94 and round(SLICED_LOSS / GiB, 2) == 0.14
    assert not plain.fits_with_headroom, _said(plain)  # 21.80 GiB: 23.4 GB of 24
    ordinary = px.plan(**FOUNDING)["zero3"]
    assert ordinary.total_bytes > 2.5 * p.total_bytes, _said(ordinary)


@pytest.mark.parametrize("offload", ["params", "optimizer"])
def test_a_full_fine_tune_with_offload(offload):
    """offload="params": the weight shards, the moments and the gradient shards in host memory,
    the card holding two units' gradient shards, the gathered units and the activations: 3.93
    GiB, within the 10 GiB target; the host 56.8 GB for both ranks, within 64 GB (90% of it
    with the headroom: 57.6). Per rank: the bf16 weights, their own masters (2 bytes a
    parameter of its half), the 8-bit moments (2.03), the bf16 gradient shard (2), and the step's
    fp32 copy of the largest run, the head's shard (16 bytes an element). offload="optimizer"
    keeps the bf16 weight shard on the card: 11.41 GiB."""
    p = _plan(**LEAN, offload=offload, host_memory="64GB")["zero3"]
    said = _said(p)
    weights = 2 * PARAMS // 2
    assert p.params_bytes == (0 if offload == "params" else weights), said
    assert p.grads_bytes == 2 * (EMBEDDING // 2 + H * H // 2) and p.optimizer_bytes == 0, said
    per_rank = weights + EIGHT_BIT * PARAMS / 2 + weights + 16 * EMBEDDING // 2
    assert p.host_bytes_per_node == 2 * per_rank, said
    assert p.host_bytes_per_node <= 0.9 * 64e9 and p.fits_host and p.fits_with_headroom, said
    if offload == "params":
        assert p.total_bytes <= 10 * GiB, said
        assert round(p.total_bytes / GiB, 2) == 3.93, said
    else:
        assert round(p.total_bytes / GiB, 2) == 11.41, said


def test_lora():
    """The bf16 base sharded by zero3 (8.03 GB a card), rank-8 adapters beside q_proj and v_proj
    (3.4M parameters) with their fp32 masters and moments, the activations (0.99 GiB) and the
    embedding or head gathered beside a block: 9.88 GiB a card, within the 10 GiB target."""
    r = _plan(lora_rank=8)
    p = r["zero3"]
    said = _said(p)
    adapters = LAYERS * ((8 * H + H * 8) + (8 * H + KV * 8))
    assert r.model["trainable_params"] == adapters, said
    assert p.params_bytes == 2 * PARAMS // 2, said  # the base; the adapters' masters are state
    assert p.optimizer_bytes == 12 * adapters // 2, said
    assert p.activations_bytes < 1.0 * GiB, said
    assert p.total_bytes == _backward_start(p), said
    assert p.total_bytes <= 10 * GiB and round(p.total_bytes / GiB, 2) == 9.88, said


def test_qlora():
    """The blocks' frozen nn.Linear weights (seven projections a block, 6.98B elements) in NF4:
    half a byte, an int8 scale per 64 and an fp32 scale per 256 of those (0.5159 bytes an
    element); the embedding, the norms and the head, the output layer, in bf16 (as bitsandbytes
    leaves it, and as px.linear_cross_entropy needs it); zero3 halves it: 2.66 GiB a card. With
    the activations (0.99 GiB), zero3's gathered roots (the bf16 embedding or head beside a
    block of 4-bit weights: 1.08 GiB) and the largest projection's bf16 dequantized copy (down,
    58.7M elements: 0.11 GiB): 4.86 GiB, within the 5 GiB target."""
    p = _plan(lora_rank=8, base_dtype="nf4")["zero3"]
    said = _said(p)
    assert NF4_BYTES == 0.5 + 1 / 64 + 4 / (64 * 256)
    quantized = LAYERS * LINEAR
    assert p.params_bytes == math.ceil((NF4_BYTES * quantized + 2 * (PARAMS - quantized)) / 2), \
        said
    assert p.buffers_detail["dequantized"] == 2 * INNER * H, said
    assert p.total_bytes == _backward_start(p), said
    assert p.total_bytes <= 5 * GiB and round(p.total_bytes / GiB, 2) == 4.86, said
    lora = _plan(lora_rank=8)["zero3"]
    assert lora.params_bytes - p.params_bytes > 4.5 * GiB, _said(lora)


def test_what_fits_instead_names_the_lean_full_fine_tune_before_offload():
    """Planned as a user first would (bf16 mixed precision, AdamW, F.cross_entropy over the
    logits), nothing fits: the alternatives name the full fine-tune in less memory first, and it
    fits under zero3 without offload; then LoRA, then offload."""
    r = px.plan(**FOUNDING)
    assert r.recommended is None
    changes = [a.change for a in r.alternatives]
    assert changes[0] == {"precision": "bf16-true", "optimizer": "adamw8bit",
                          "step_in_backward": True, "sliced_loss": True}, changes
    assert changes.index({"lora_rank": 8, "lora_targets": ("q_proj", "v_proj")}) \
        < changes.index({"offload": "optimizer"}), changes
    lean = r.alternatives[0]
    assert list(lean.fits) == ["zero3"] and round(lean.fits["zero3"] / GiB, 2) == 19.01, \
        lean.line
    assert lean.line.startswith("a full fine-tune in less memory (precision='bf16-true', "
                                "optimizer='adamw8bit', step_in_backward=True, "
                                "sliced_loss=True)"), lean.line
    # a card of 12 GB: LoRA does not fit, QLoRA does, and is named
    small = px.plan(**{**FOUNDING, "gpu_memory": "12GB"}, lora_rank=8)
    assert small.recommended is None
    qlora = small.alternatives[0]
    assert qlora.change == {"base_dtype": "nf4"}, qlora.line
    assert "zero3" in qlora.fits and "over a 4-bit base (base_dtype='nf4')" in qlora.line, \
        qlora.line


def test_low_bit_state_bytes():
    """torchao's AdamW8bit and AdamW4bit: (bytes per element, elements per fp32 scale) of each
    of the two moments, on top of bf16 mixed precision's fp32 master."""
    assert QUANTIZED_STATES == {"adamw8bit": (1, 256), "adamw4bit": (0.5, 128)}
    psi = 256 * 10**6
    for optimizer, per in (("adamw8bit", 2 * (1 + 4 / 256)), ("adamw4bit", 2 * (0.5 + 4 / 128))):
        ddp = px.plan(params=psi, gpus=1, precision="bf16", optimizer=optimizer)["ddp"]
        assert ddp.optimizer_bytes == 4 * psi + per * psi, optimizer


def test_the_step_in_backward_is_px_prepares_and_refused_where_it_is():
    spec = Spec.of(strategy="zero3", precision="bf16", step_in_backward=True)
    r = px.plan(params=1e9, gpus=2, spec=spec)
    assert r.setting["step_in_backward"] is True and list(r.strategies) == ["zero3"]
    # zero2 keeps two units' gradient shards where the ordinary step keeps its whole shard
    plain, stepped = (px.plan(params=1e9, gpus=2, strategy="zero2", step_in_backward=s)["zero2"]
                      for s in (False, True))
    assert stepped.grads_bytes == 2 * 13_107_200 and plain.grads_bytes == 10**9
    # ddp and zero1 keep their full gradient buckets
    ddp = px.plan(params=1e9, gpus=2, strategy="ddp", step_in_backward=True)["ddp"]
    assert ddp.grads_bytes == 2 * 10**9
    for options, words in (({"offload": "optimizer"}, "steps on the host after backward"),
                           ({"precision": "fp16"}, "overflow check")):
        with pytest.raises(ValueError, match=words):
            px.plan(params=1e9, gpus=2, step_in_backward=True, **options)
    with pytest.raises(ValueError, match="nothing is frozen: give lora_rank"):
        px.plan(params=1e9, gpus=2, base_dtype="nf4")
    with pytest.raises(ValueError, match="unknown base_dtype 'int3'"):
        px.plan(params=1e9, gpus=2, lora_rank=8, base_dtype="int3")


def test_the_command_line_takes_the_recipes(capsys, tmp_path):
    argv = ["plan", "--params", "8e9", "--gpus", "2", "--gpu", "rtx3090", "--strategy", "zero3",
            "--precision", "bf16-true", "--optimizer", "adamw8bit", "--step-in-backward",
            "--json"]
    assert phalanx_main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setting"]["step_in_backward"] is True
    assert data["setting"]["optimizer_state_bytes_per_param"] == EIGHT_BIT
    assert phalanx_main(["plan", "--params", "8e9", "--gpus", "2", "--gpu", "rtx3090",
                         "--lora-rank", "8", "--base-dtype", "nf4", "--strategy", "zero3"]) == 0
    text = capsys.readouterr().out
    assert "bf16, adamw, nf4 base;" in text and "nf4 base: frozen nn.Linear weights 4-bit" in text
    config = tmp_path / "llama-3.1-8b.json"
    config.write_text(json.dumps(LLAMA_3_1_8B))
    assert phalanx_main(["plan", "--config", str(config), "--gpus", "2", "--gpu", "rtx3090",
                         "--strategy", "zero3", "--activation-checkpointing", "--attention",
                         "flash", "--precision", "bf16-true", "--optimizer", "adamw8bit",
                         "--step-in-backward", "--sliced-loss", "--units", "GiB"]) == 0
    text = capsys.readouterr().out
    assert "activation checkpointing on, sliced loss" in text and "19.01" in text, text
    assert "sliced_loss: px.linear_cross_entropy keeps one fp32 log-sum-exp" in text


# docs/guides/planner.md's table: GiB per card, host GiB per node (0: none)
GUIDE = {
    "full": ({**LEAN, "step_in_backward": True},
             (7.48, 0.50, 7.60, 0.99, 3.41, 0.06, 19.01, 0)),
    "offload params": ({**LEAN, "offload": "params", "host_memory": "64GB"},
                       (0.00, 0.50, 0.00, 0.99, 3.41, 0.00, 3.93, 52.93)),
    "offload optimizer": ({**LEAN, "offload": "optimizer", "host_memory": "64GB"},
                          (7.48, 0.50, 0.00, 0.99, 3.41, 0.00, 11.41, 52.93)),
    "lora": ({"lora_rank": 8}, (7.48, 0.00, 0.02, 0.99, 1.39, 0.01, 9.88, 0)),
    "qlora": ({"lora_rank": 8, "base_dtype": "nf4"},
              (2.66, 0.00, 0.02, 0.99, 1.19, 0.01, 4.86, 0)),
}


@pytest.mark.parametrize("recipe", list(GUIDE))
def test_the_guides_table(recipe):
    options, figures = GUIDE[recipe]
    p = _plan(**options)["zero3"]
    planned = tuple(round(b / GiB, 2) for b in (
        p.params_bytes, p.grads_bytes, p.optimizer_bytes, p.activations_bytes, p.buffers_bytes,
        p.step_working_bytes, p.total_bytes, p.host_bytes_per_node))
    assert planned == figures, _said(p)


def test_the_head_stepped_a_piece_at_a_time():
    from phalanx.engine.units import step_run_bytes
    from phalanx.planner.memory import step_working_bytes
    from phalanx.spec.precisions import precision_spec

    p = _plan(**LEAN, step_in_backward=True)["zero3"]
    assert EMBEDDING // 2 == 262_668_288
    # the head's shard stepped whole would take 3.91 GiB (fp32 weights, gradients, two
    # moments); cut at the cap, 64 MiB, what the plan says
    whole = step_working_bytes("adamw8bit", precision_spec("bf16-true"), [EMBEDDING // 2],
                               foreach=True, run_bytes=step_run_bytes(25.0))
    assert whole == 16 * PIECE_CAP == p.step_working_bytes
    assert round(16 * (EMBEDDING // 2) / GiB, 2) == 3.91
