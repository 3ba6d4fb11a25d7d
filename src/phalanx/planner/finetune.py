"""Fine-tuning in the plan: LoRA adapters, or a trainable fraction, over a described model.

`px.plan(..., lora_rank=R)` plans the model with every parameter frozen and a pair of low-rank
adapters beside each target projection of each block (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", arXiv:2106.09685): A of shape (R, in) and B of shape
(out, R), trainable, as PEFT's `LoraConfig(r=R, target_modules=...)` adds them. The targets
default to ("q_proj", "v_proj"), PEFT's default for Llama-family models; a target names a
module as PEFT's does, by its full name or its last part(s) (`q_proj` matches
`model.layers.0.self_attn.q_proj`).
- A module or factory: the model is copied on the meta device (nothing is allocated), every
  target `nn.Linear` is wrapped with its adapters, and the copy is planned as any module is:
  its units, its zero3 roots and its traced activations and FLOPs (autograd saves only what
  the adapters' gradients need).
- A config: the projections of a Llama-style block, named q_proj, k_proj, v_proj, o_proj,
  gate_proj (gated MLPs), up_proj and down_proj, with the config's sizes; activations are full
  training's, an upper bound (a frozen layer's input need not be kept).
- A bare count: the same projections of the stand-in shape of transformer.py's
  `nominal_shape` (layers of 12 h^2 parameters, hidden = 128 x layers).

`trainable=FRACTION` plans a model of which that fraction of the parameters learns and the rest
is frozen, without saying which: the trainable ones are laid out as a count is.

`base_dtype="nf4"` (QLoRA) stores the frozen nn.Linear weights in 4 bits (memory.py's [Note:
Low-bit optimizer state and a 4-bit base]); `quantized_elements` says how many elements that
is: from shapes with the frozen ones marked (a module, LoRA on a config), exactly; with a
trainable fraction, that fraction of the Linear weights learning; from a bare count, every
frozen parameter.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import replace

import torch
from torch import nn

from .memory import NF4_CHUNK
from .model_desc import ModelDesc, from_module
from .transformer import TransformerShape, nominal_shape

__all__ = ["DEFAULT_LORA_TARGETS", "BASE_DTYPES", "LoRALinear", "add_lora", "finetuned",
           "check_finetune", "check_base_dtype", "check_frozen", "quantized_elements"]

DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")
BASE_DTYPES = ("nf4",)  # how a frozen base may be stored, besides the compute dtype


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` with a trainable low-rank update beside it: base(x) + B(A(x)), in
    PEFT's layout (base_layer, lora_A, lora_B; B starts at zero, as PEFT's does)."""

    def __init__(self, base: nn.Linear, rank: int):
        super().__init__()
        self.base_layer = base
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
        if device.type != "meta":
            nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def add_lora(model: nn.Module, rank: int, targets=DEFAULT_LORA_TARGETS) -> int:
    """Freeze `model` and wrap, in place, each `nn.Linear` named by `targets` (its full name or
    its last part(s), as PEFT's target_modules) in a LoRALinear; the number wrapped. The planner
    does it to a meta copy; benchmarks/plan_vs_measured.py to the model it trains."""
    model.requires_grad_(False)
    found = [(name, m) for name, m in model.named_modules() if _matches(name, targets)]
    wrong = [f"{name} ({type(m).__name__})" for name, m in found if not isinstance(m, nn.Linear)]
    if wrong:
        raise ValueError(f"lora_targets: adapters go beside nn.Linear layers, and "
                         f"{', '.join(wrong[:3])} is not one")
    if not found:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if isinstance(m, nn.Linear)})
        raise ValueError(f"lora_targets {', '.join(targets)}: no such nn.Linear in the model "
                         f"(its Linear layers are named {', '.join(names[:12]) or 'nothing'})")
    for name, linear in found:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LoRALinear(linear, rank))
    return len(found)


def check_finetune(lora_rank, lora_targets, trainable):
    """(lora_rank, targets, trainable) checked; ValueError with one line otherwise."""
    if lora_rank is not None and trainable is not None:
        raise ValueError("give lora_rank (adapters) or trainable (a fraction of the model), "
                         "not both")
    if lora_rank is not None and (isinstance(lora_rank, bool) or not isinstance(lora_rank, int)
                                  or lora_rank < 1):
        raise ValueError(f"lora_rank must be a positive integer (8, 16, 64...), got "
                         f"{lora_rank!r}")
    if trainable is not None:
        if isinstance(trainable, bool) or not isinstance(trainable, (int, float)) \
                or not 0 < trainable <= 1:
            raise ValueError(f"trainable is the fraction of the parameters that learn, in "
                             f"(0, 1], e.g. 0.01; got {trainable!r}")
        trainable = float(trainable)
    targets = lora_targets if lora_targets is not None else DEFAULT_LORA_TARGETS
    if isinstance(targets, str):
        targets = [t for t in targets.replace(" ", "").split(",") if t]
    targets = tuple(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"lora_targets names the projections to adapt, e.g. "
                         f"q_proj,v_proj; got {lora_targets!r}")
    if lora_targets is not None and lora_rank is None:
        raise ValueError("lora_targets goes with lora_rank (the adapters' rank)")
    return lora_rank, targets, trainable


def check_base_dtype(base_dtype):
    """`base_dtype` in one spelling (None: the compute dtype); ValueError with one line
    otherwise. (That something is frozen is checked against the model: `check_frozen`.)"""
    if base_dtype is None:
        return None
    key = str(base_dtype).strip().lower()
    if key not in BASE_DTYPES:
        raise ValueError(f"unknown base_dtype {base_dtype!r}: choose nf4 (a frozen base stored "
                         "4-bit, QLoRA) or leave it out (the compute dtype)")
    return key


def check_frozen(desc: ModelDesc, base_dtype) -> None:
    """A 4-bit base needs frozen parameters to store: ValueError with one line otherwise."""
    if base_dtype is not None and desc.frozen_params == 0:
        raise ValueError(f"base_dtype={base_dtype!r} stores the frozen parameters 4-bit, and "
                         "nothing is frozen: give lora_rank (QLoRA) or trainable, or a model "
                         "with frozen parameters")


def quantized_elements(desc: ModelDesc) -> tuple[int, int | None, str | None]:
    """(elements of the frozen nn.Linear weights that a 4-bit base stores in NF4, those of a
    whole number of 64 x 256 elements; the largest such weight's, None where not known; a note
    where they are estimated)."""

    def stored(shape, linear):  # an nn.Linear weight of whole NF4 blocks (model/nf4_base.py)
        return linear and len(shape) == 2 and math.prod(shape) % NF4_CHUNK == 0

    frozen = desc.frozen_params
    if desc.param_linear is not None and desc.param_trainable is not None:
        sizes = [math.prod(s) for s, linear, learns in zip(
            desc.param_shapes, desc.param_linear, desc.param_trainable)
            if stored(s, linear) and not learns]
        return sum(sizes), max(sizes, default=0), None
    if desc.param_linear is not None:
        sizes = [math.prod(s) for s, is_linear in zip(desc.param_shapes, desc.param_linear)
                 if stored(s, is_linear)]
        share = frozen / max(desc.params, 1)
        return round(sum(sizes) * share), max(sizes, default=0), (
            f"nf4 base: which parameters are frozen is not said; {share:.0%} of the Linear "
            "weights taken as frozen")
    return frozen, None, ("nf4 base from a bare count: every frozen parameter taken as a "
                          "Linear weight (norms and embeddings stay in the compute dtype: give "
                          "--config or --model for the model's own)")


def finetuned(desc: ModelDesc, lora_rank, targets, trainable) -> ModelDesc:
    """`desc` with its frozen and trainable parameters as the fine-tuning options say."""
    if lora_rank is not None:
        if desc.module is not None:
            return _lora_module(desc, lora_rank, targets)
        return _lora_shapes(desc, lora_rank, targets)
    if trainable is not None:
        learning = max(1, round(trainable * desc.params))
        return replace(desc, trainable_params=learning, trainable_shapes=None,
                       trainable_blocks=None, param_trainable=None,
                       frozen_share=1 - learning / desc.params,
                       finetune={"trainable": trainable}, notes=list(desc.notes) + [
                           f"trainable {trainable:g}: {learning:,} parameters learn, laid out "
                           "as a count (which ones is not said); activations are full "
                           "training's, an upper bound"])
    return desc


# -- a module or factory ------------------------------------------------------------------------
def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters and buffers are on the meta device: no memory."""
    memo = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        twin = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(twin, t.requires_grad) if isinstance(t, nn.Parameter) \
            else twin
    try:
        return copy.deepcopy(module, memo)
    except Exception as exc:  # noqa: BLE001 - say which model and why, in one line
        raise ValueError(f"lora_rank: the model cannot be copied to add adapters on the meta "
                         f"device ({type(exc).__name__}: {exc}); give it as a factory "
                         "(--model PATH:FUNCTION) or a config") from None


def _matches(name: str, targets) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _lora_module(desc: ModelDesc, rank: int, targets) -> ModelDesc:
    model = _meta_copy(desc.module)
    adapted = add_lora(model, rank, targets)
    planned = from_module(model, name=desc.name, make_input=desc.make_input,
                          blocks=desc.block_classes)
    return replace(planned, notes=list(dict.fromkeys(desc.notes + planned.notes)), finetune={
        "lora_rank": rank, "lora_targets": list(targets), "adapted_layers": adapted,
        "adapter_params": planned.trainable_params})


# -- a config or a count ------------------------------------------------------------------------
def _projections(shape: TransformerShape) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a Llama-style block, by its Hugging Face name."""
    h, hk, i = shape.hidden, shape.kv_hidden, shape.intermediate
    out = {"q_proj": (h, h), "k_proj": (hk, h), "v_proj": (hk, h), "o_proj": (h, h)}
    if shape.gated_mlp:
        out["gate_proj"] = (i, h)
    out.update(up_proj=(i, h), down_proj=(h, i))
    return out


def _lora_shapes(desc: ModelDesc, rank: int, targets) -> ModelDesc:
    shape = desc.transformer if desc.transformer is not None else nominal_shape(desc.params)
    projections = _projections(shape)
    unknown = [t for t in targets if t not in projections]
    if unknown:
        raise ValueError(f"lora_targets {', '.join(unknown)}: a config or a count names a "
                         f"block's projections {', '.join(projections)} (for other names, "
                         "give the model as a module or factory)")
    per_layer = [s for t in targets
                 for s in ((rank, projections[t][1]), (projections[t][0], rank))]
    adapters = [s for _ in range(shape.layers) for s in per_layer]
    adapter_blocks = [layer for layer in range(shape.layers) for _ in per_layer]
    added = sum(math.prod(s) for s in adapters)
    param_shapes = param_blocks = param_trainable = param_linear = None
    if desc.param_shapes is not None:  # each layer's adapters after the layer's own weights
        param_shapes, param_blocks, param_trainable, param_linear = [], [], [], []
        pending = {layer: per_layer for layer in range(shape.layers)}
        blocks = list(desc.param_blocks) + [None]
        linear = desc.param_linear or [len(s) == 2 for s in desc.param_shapes]
        for i, s in enumerate(desc.param_shapes):
            param_shapes.append(s)
            param_blocks.append(blocks[i])
            param_trainable.append(False)
            param_linear.append(linear[i])
            if blocks[i] is not None and blocks[i + 1] != blocks[i]:
                param_shapes += pending.pop(blocks[i])
                param_blocks += [blocks[i]] * len(per_layer)
                param_trainable += [True] * len(per_layer)
                param_linear += [True] * len(per_layer)
    notes = list(desc.notes)
    if desc.transformer is None:
        notes.append(f"LoRA adapters from a bare count are sized for a stand-in shape of "
                     f"{shape.layers} layers of hidden size {shape.hidden}; give --config for "
                     "the model's own")
    else:
        notes.append("activations are full training's: an upper bound for frozen layers, "
                     "whose inputs autograd need not keep")
    return replace(desc, params=desc.params + added, trainable_params=added,
                   trainable_shapes=adapters, trainable_blocks=adapter_blocks,
                   param_shapes=param_shapes, param_blocks=param_blocks,
                   param_trainable=param_trainable, param_linear=param_linear,
                   frozen_share=1.0,
                   notes=notes, finetune={
                       "lora_rank": rank, "lora_targets": list(targets),
                       "adapted_layers": shape.layers * len(targets), "adapter_params": added})
