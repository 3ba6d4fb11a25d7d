"""A decoder-only transformer described by its shape: parameters, activations and FLOPs.

The shape comes from a Hugging Face style `config.json` (GPT-2 names such as `n_embd` and
Llama/BERT names such as `hidden_size` are both read); nothing is downloaded or built.

[Note: Activation formula]
Activation memory is what autograd saves for the backward pass. Per layer and per token, with
element size `e` bytes (2 for 16-bit, 4 for fp32), hidden size h, attention heads a, key/value
width h_kv, MLP width I and sequence length s, the tensors saved are:

    norm inputs 2h, attention input h, q/k/v 3h, softmax output a*s, attention output h,
    MLP input h, MLP inner 2I (GELU: pre- and post-activation) or 4I (gated: gate, up,
    act(gate), product), plus two fp32 norm statistics (8 bytes each),
    and with dropout: one 1-byte mask per dropout and a second a*s copy after attention dropout.

(Eager attention repeats grouped k/v heads to every head before the matmul, so q/k/v is 3h.)
With I = 4h, dropout on, 1-byte masks and e = 2 this is exactly s*b*h*(34 + 5*a*s/h) bytes per
layer, the formula of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198), Sec. 4.1. With `attention="flash"` the a*s terms become
one fp32 log-sum-exp per head (FlashAttention, Dao 2023, keeps no s x s matrix), and q/k/v are
h + 2h_kv (the kernel takes grouped k/v as they are). The kernel's output is the output
projection's input: kernels return it in (batch, seq, heads, dim) layout, so merging heads is a
view.
Outside the layers: token ids, final norm input h, LM-head input h and the fp32 log-softmax of
the loss, 4*V bytes per token (with `px.linear_cross_entropy`, a loss computed a slice of the
vocabulary at a time, one fp32 log-sum-exp per token, 4 bytes, and at the start of backward one
slice's working memory instead of the whole vocabulary's: `loss_transient_bytes`). With full
activation checkpointing each layer keeps only its input (e*h per token) and one layer at a
time is recomputed in full during backward.
The planner adds the loss's working memory at the start of backward (`loss_transient_bytes`):
the peak comes then, with every activation still saved.
`tests/test_plan_activations.py` checks all of this against a measured forward/backward of the
reference model built from the same config (`reference_model.py`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..model.linear_loss import chunk_rows

__all__ = ["TransformerShape", "shape_from_config", "nominal_shape"]

# Config keys by meaning, first match wins.
_KEYS = {
    "hidden": ("hidden_size", "n_embd", "d_model", "dim", "model_dim"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "vocab": ("vocab_size", "padded_vocab_size", "n_vocab"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size",
                     "ffn_dim_size"),
    "kv_heads": ("num_key_value_heads", "n_head_kv", "num_kv_heads", "n_kv_heads"),
    "positions": ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len"),
}
_ATTN_DROPOUT = ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout")
_HIDDEN_DROPOUT = ("resid_pdrop", "embd_pdrop", "hidden_dropout_prob", "hidden_dropout",
                   "dropout")
# Families with gated (SwiGLU/GeGLU) MLPs, no biases, rotary positions and untied heads.
_LLAMA_LIKE = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "olmo",
               "olmo2", "phi3", "granite", "cohere", "deepseek_v2", "deepseek_v3", "internlm2"}
_LEARNED_POSITIONS = {"gpt2", "gpt_bigcode", "opt", "bert", "roberta", "distilbert", "gpt_neo",
                      "electra", "xlm-roberta", "biogpt"}


@dataclass(frozen=True)
class TransformerShape:
    """What the arithmetic needs to know about a decoder-only transformer."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    intermediate: int
    kv_heads: int
    gated_mlp: bool = False
    bias: bool = True
    learned_positions: int = 0  # rows of a learned position table (0: rotary or none)
    tied_embeddings: bool = True
    attn_dropout: bool = False
    hidden_dropout: bool = False
    name: str = "transformer"

    @property
    def kv_hidden(self) -> int:
        return self.hidden * self.kv_heads // self.heads

    def to_dict(self) -> dict:
        return asdict(self)

    # ---- parameters -------------------------------------------------------------------------
    def layer_param_shapes(self) -> list[tuple[int, ...]]:
        """In module order (as reference_model.Block registers them): the order matters to the
        engine's bucket layout (layout.py), not to any count."""
        h, hk, i = self.hidden, self.kv_hidden, self.intermediate

        def linear(out_features, in_features):
            return [(out_features, in_features)] + ([(out_features,)] if self.bias else [])

        norm = [(h,), (h,)] if self.bias else [(h,)]
        mlp = linear(i, h) + (linear(i, h) if self.gated_mlp else []) + linear(h, i)
        attention = linear(h, h) + linear(hk, h) + linear(hk, h) + linear(h, h)
        if self.gated_mlp:  # Llama's order: attention, MLP, the two norms
            return attention + mlp + norm + norm
        return norm + attention + norm + mlp

    def outer_param_shapes(self) -> list[tuple[int, ...]]:
        """Embeddings, final norm and (when untied) the LM head."""
        return self._before_layers() + self._after_layers()

    def _before_layers(self):
        shapes = [(self.vocab, self.hidden)]
        if self.learned_positions:
            shapes.append((self.learned_positions, self.hidden))
        return shapes

    def _after_layers(self):
        h = self.hidden
        shapes = [(h,), (h,)] if self.bias else [(h,)]
        if not self.tied_embeddings:
            shapes.append((self.vocab, h))
        return shapes

    def param_shapes(self) -> list[tuple[int, ...]]:
        """Every parameter's shape, in module order."""
        return (self._before_layers() + self.layer_param_shapes() * self.layers
                + self._after_layers())

    def param_blocks(self) -> list:
        """The layer each parameter of `param_shapes()` sits in (None outside the layers)."""
        per_layer = len(self.layer_param_shapes())
        return ([None] * len(self._before_layers())
                + [i for i in range(self.layers) for _ in range(per_layer)]
                + [None] * len(self._after_layers()))

    def param_linear(self) -> list[bool]:
        """Which of `param_shapes()` a 4-bit base stores in NF4: the nn.Linear weights of the
        blocks (not the embeddings, and not the head, the output layer, which it leaves in the
        compute dtype: model/nf4_base.py)."""
        before, after = self._before_layers(), self._after_layers()
        return ([False] * len(before)
                + [len(s) == 2 for s in self.layer_param_shapes()] * self.layers
                + [False] * len(after))

    def loss_bytes(self, batch: int, seq: int, sliced: bool = False, elem: int = 2) -> int:
        """The loss's memory at the start of backward: what it saved (`loss_saved_bytes`) and
        its working memory then (`loss_transient_bytes`), all freed by the loss's backward,
        before the head has a gradient."""
        return (self.loss_saved_bytes(batch, seq, sliced)
                + self.loss_transient_bytes(batch, seq, sliced, elem))

    def loss_saved_bytes(self, batch: int, seq: int, sliced: bool = False) -> int:
        """What the loss keeps for backward: F.cross_entropy its fp32 log-softmax, 4V bytes per
        token; px.linear_cross_entropy one fp32 log-sum-exp per token (see [Note: Activation
        formula])."""
        return 4 * (1 if sliced else self.vocab) * batch * seq

    def layer_params(self) -> int:
        return sum(math.prod(s) for s in self.layer_param_shapes())

    def params(self) -> int:
        return (sum(math.prod(s) for s in self.outer_param_shapes())
                + self.layers * self.layer_params())

    # ---- activations (see [Note: Activation formula]) ---------------------------------------
    def layer_activation_bytes(self, batch: int, seq: int, elem: int, attention: str = "eager",
                               mask_bytes: int = 1) -> int:
        h, a, i = self.hidden, self.heads, self.intermediate
        # norm inputs, attention input, output, MLP input
        per_token = elem * (2 * h + h + h + h)
        per_token += elem * (4 * i if self.gated_mlp else 2 * i)
        per_token += 2 * 8                                 # fp32 norm statistics
        if attention == "flash":
            per_token += elem * (h + 2 * self.kv_hidden)   # q, k, v as the kernel takes them
            per_token += 4 * a                             # fp32 log-sum-exp per head
        else:
            per_token += elem * 3 * h                      # q, k, v (k/v repeated to every head)
            per_token += elem * a * seq                    # softmax output
            if self.attn_dropout:
                per_token += (elem + mask_bytes) * a * seq  # dropped copy, mask
        if self.hidden_dropout:
            per_token += 2 * mask_bytes * h                # after attention and after MLP
        return batch * seq * per_token

    def outer_activation_bytes(self, batch: int, seq: int, elem: int, mask_bytes: int = 1,
                               sliced: bool = False) -> int:
        h = self.hidden
        per_token = 8 + 8                        # token ids and targets (int64)
        per_token += elem * h + 8 + elem * h     # final norm input and stats, LM-head input
        if self.hidden_dropout:
            per_token += mask_bytes * h          # embedding dropout mask
        return batch * seq * per_token + self.loss_saved_bytes(batch, seq, sliced)

    def activation_bytes(self, batch: int, seq: int, elem: int, checkpointing: bool = False,
                         attention: str = "eager", mask_bytes: int = 1,
                         sliced: bool = False) -> int:
        """Saved-for-backward bytes of one micro-batch. `mask_bytes` is the size of a dropout
        mask element: 1 on GPU (a bool mask), the activation's own size on CPU, where PyTorch
        keeps the scaled noise tensor instead. `sliced`: the loss is px.linear_cross_entropy's
        (`loss_saved_bytes`)."""
        layer = self.layer_activation_bytes(batch, seq, elem, attention, mask_bytes)
        outer = self.outer_activation_bytes(batch, seq, elem, mask_bytes, sliced)
        if checkpointing:
            return outer + self.layers * batch * seq * elem * self.hidden + layer
        return outer + self.layers * layer

    def loss_transient_bytes(self, batch: int, seq: int, sliced: bool = False,
                             elem: int = 2) -> int:
        """Working memory at the start of backward, on top of what is saved: the fp32 gradients
        of the log-probabilities and of the logits, 2 x 4 x V bytes per token; sliced
        (px.linear_cross_entropy), one slice's fp32 logits, turned into their softmax in
        place, beside the logits in the compute dtype (made by the matmul, then the softmax's
        gradient cast back for the next two), 4 + elem bytes per element of tokens x the
        slice's rows (model/linear_loss.py's `chunk_rows`),
        and the hidden states' gradient, added up in fp32 beside each slice's in the compute
        dtype, (4 + elem) x hidden per token (benchmarks/sliced_loss.py measures it)."""
        tokens = batch * seq
        if not sliced:
            return 8 * self.vocab * tokens
        return (4 + elem) * tokens * (chunk_rows(tokens, self.vocab) + self.hidden)

    # ---- compute ----------------------------------------------------------------------------
    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token (forward + backward, no recomputation): 6 x the weights
        of matrix multiplies (layers' matrices and the LM head; lookups, norms and biases are
        not matmuls) plus the
        attention scores and weighted sum, 12 * layers * seq * hidden (Chowdhery et al. 2022,
        PaLM, App. B)."""
        return 6.0 * self.matmul_params() + 12.0 * self.layers * seq * self.hidden

    def matmul_params(self) -> int:
        """The weights of matrix multiplies: the layers' matrices and the LM head."""
        layer_matrices = sum(math.prod(s) for s in self.layer_param_shapes() if len(s) == 2)
        return self.layers * layer_matrices + self.vocab * self.hidden


def _get(config: dict, field: str, source: str, required: bool = True):
    for key in _KEYS[field]:
        if key in config:
            return config[key]
    if required:
        raise ValueError(f"{source} has no {field} size: add one of {', '.join(_KEYS[field])}")
    return None


def shape_from_config(config: dict, source: str = "config") -> TransformerShape:
    """Read a Hugging Face style config dict. Missing required fields raise one-line errors."""
    if not isinstance(config, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(config).__name__}")
    if "text_config" in config and _get(config, "hidden", source, required=False) is None:
        config = config["text_config"]  # multimodal configs keep the language model inside
    model_type = str(config.get("model_type", "")).lower()
    missing = [f for f in ("hidden", "layers", "heads", "vocab")
               if _get(config, f, source, required=False) is None]
    if missing:
        keys = "; ".join(f"{f}: {' or '.join(_KEYS[f][:2])}" for f in missing)
        raise ValueError(f"{source} is missing the {', '.join(missing)} size"
                         f"{'s' if len(missing) > 1 else ''} ({keys})")
    hidden = _get(config, "hidden", source)
    layers = _get(config, "layers", source)
    heads = _get(config, "heads", source)
    vocab = _get(config, "vocab", source)
    act = str(config.get("hidden_act", config.get("activation_function", ""))).lower()
    gated = config.get("gated_mlp")
    if gated is None:
        gated = model_type in _LLAMA_LIKE or act in ("silu", "swish", "swiglu", "geglu")
    inter = _get(config, "intermediate", source, required=False)
    if inter is None:
        if "n_inner" in config:  # GPT-2 writes null for the default 4h
            inter = 4 * int(hidden)
        else:
            raise ValueError(f"{source} has no intermediate (MLP) size: add one of "
                             f"{', '.join(_KEYS['intermediate'])}")
    kv = _get(config, "kv_heads", source, required=False) or heads
    values = {"hidden": hidden, "layers": layers, "heads": heads, "vocab": vocab,
              "intermediate": inter, "kv_heads": kv}
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{source}: {name} size must be a positive integer, got {value!r}")
    if hidden % heads or heads % kv:
        raise ValueError(f"{source}: hidden size {hidden} must divide by heads {heads}, "
                         f"and heads by key/value heads {kv}")
    bias = config.get("bias", config.get("attention_bias", model_type not in _LLAMA_LIKE
                                          and not (gated and not model_type)))
    learned = 0
    if (model_type in _LEARNED_POSITIONS or "n_positions" in config
            or config.get("position_embedding_type") == "absolute"):
        learned = int(_get(config, "positions", source, required=False) or 0)

    def _dropout(keys):
        return any(float(config.get(k) or 0.0) > 0.0 for k in keys)

    return TransformerShape(
        hidden=hidden, layers=layers, heads=heads, vocab=vocab, intermediate=inter, kv_heads=kv,
        gated_mlp=bool(gated), bias=bool(bias), learned_positions=learned,
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),
        attn_dropout=_dropout(_ATTN_DROPOUT), hidden_dropout=_dropout(_HIDDEN_DROPOUT),
        name=str(config.get("_name_or_path") or model_type or "transformer"),
    )


def nominal_shape(params: int) -> TransformerShape:
    """A stand-in shape for a bare parameter count, used only for Adafactor's factored state,
    which depends on matrix shapes: layers of 12*h^2 parameters with hidden = 128 * layers, the
    aspect ratio of GPT-3 and Llama models."""
    layers = max(1, round((params / (12 * 128 ** 2)) ** (1 / 3)))
    hidden = max(1, int(math.sqrt(params / (12 * layers))))
    heads = max(1, hidden // 128)
    return TransformerShape(hidden=hidden, layers=layers, heads=heads, vocab=0,
                            intermediate=4 * hidden, kv_heads=heads, bias=False, name="nominal")
