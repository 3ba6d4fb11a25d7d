"""What `px.export` writes of a LoRA model: the merged model under the base model's names
(`merge_lora=True`), or the adapter alone as PEFT saves it (`adapter=True`).

[Note: a LoRA model exported]
A LoRA model as PEFT's `get_peft_model` makes it holds the base model under `base_model.model.`
and, in place of each adapted nn.Linear, a LoRA layer: the original as `base_layer`, and per
adapter `lora_A.<adapter>` (r x in) and `lora_B.<adapter>` (out x r), with the scaling
(lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA) in `scaling[<adapter>]` (PEFT's
LoraLayer; a model of one's own may hold one number). PEFT's `merge_and_unload()` gives the
base architecture back: each LoRA layer replaced by its base layer, whose weight becomes
W + (B @ A) * scaling (LoraLayer's `get_delta_weight`), and a module in `modules_to_save`
replaced by its active adapter's copy.

`merge_lora=True` writes that model without making it: the entries are the base model's names
(the prefix and the wrappers' components taken off, peft_names.py's `base_name`), each LoRA
layer's adapter tensors left out, and the base weight of each layer an entry that carries its
merge (`Merge`). Its pieces stream as any tensor's do ([Note: an export streams] in export.py),
and rank 0 adds to each piece, as it arrives, the rows of (B @ A) * scaling that the piece
covers, a bounded number of rows at a time (`merged`); A and B, which every rank sends first,
are the only whole tensors it holds beside the piece. What cannot be merged so is refused on
every rank before anything is written: LoRA over another layer than nn.Linear (an embedding, a
convolution), several active adapters, DoRA and PEFT's other variants, lora_bias, fan_in_fan_out,
adapters already merged, and an adapter's tensor outside any LoRA layer (prompt learning).

`adapter=True` writes what PEFT's `save_pretrained` writes: the directory's
`adapter_model.safetensors` under the keys of PEFT's `get_peft_model_state_dict`
(peft_names.py's `adapter_keys`), and `adapter_config.json` from the model's `peft_config`.
"""

from __future__ import annotations

import enum
import json
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..model.peft_names import (
    adapter_keys,
    adapter_names,
    adapter_scope,
    base_name,
    listed,
    peft_prefix,
)
from .export import Entry, output_dtype
from .files import fsync_dir, write_text

__all__ = ["Merge", "merged_entries", "adapter_entries", "adapter_config", "merged",
           "write_config", "ADAPTER_FILE", "ADAPTER_CONFIG", "ROWS"]

ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's SAFETENSORS_WEIGHTS_NAME
ADAPTER_CONFIG = "adapter_config.json"      # PEFT's CONFIG_NAME
ROWS = 2**16  # elements of (B @ A) made at a time: 256 KiB in fp32 (see `merged`)
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
               "lora_magnitude_vector")


@dataclass
class Merge:
    """A LoRA layer's base weight written merged: W + (B @ A) * scaling, computed in `dtype`.
    `a` and `b` name the adapter's tensors (their first names in the state_dict)."""
    layer: str
    a: str
    b: str
    scaling: float
    dtype: torch.dtype


def lora_layers(module: nn.Module) -> dict[str, nn.Module]:
    """path -> LoRA layer: a module holding `base_layer` beside PEFT's LoRA parts."""
    return {path: m for path, m in module.named_modules()
            if "base_layer" in m._modules and any(p in m._modules for p in _LORA_PARTS)}


def _held(layer: nn.Module, part: str) -> list[str]:
    return list(getattr(layer._modules.get(part), "keys", lambda: [])())


def _active(layer: nn.Module, held: list[str]) -> list[str]:
    """The adapters of `held` that the layer uses: PEFT's `active_adapters`, else all."""
    active = getattr(layer, "active_adapters", None)
    if active is None:
        active = getattr(layer, "active_adapter", None)
    if active is None:
        return held
    active = [active] if isinstance(active, str) else list(active)
    return [a for a in active if a in held]


def merged_entries(call: str, module: nn.Module, names: dict[int, str], aliases: dict[str, str],
                   shapes: dict, dtype) -> list:
    """The entries of a merged export of `module` (see [Note: a LoRA model exported]), in its
    state_dict's order; raises ValueError naming everything that cannot be merged. `names`:
    id(tensor) -> its first name; `aliases`: a later name -> the first; `shapes`: first name ->
    (shape, dtype saved)."""
    layers = lora_layers(module)
    if not layers:
        raise ValueError(
            f"{call}: merge_lora=True merges LoRA layers into their base weights, and this model "
            "has none (no module holding `base_layer` beside `lora_A` and `lora_B`, as PEFT's "
            "get_peft_model makes them); export without merge_lora")
    problems: list[str] = []
    merges: dict[str, Merge] = {}
    several, refused = {}, {}  # path -> its active adapters; reason -> the layers it refuses
    for path, layer in layers.items():
        held = list(dict.fromkeys(_held(layer, "lora_A") + _held(layer, "lora_embedding_A")))
        active = _active(layer, held)
        if len(active) > 1:
            several[path] = active
        elif active:
            merge = _merge_of(path, layer, active[0], names, shapes)
            if isinstance(merge, Merge):
                merges[names[id(layer.base_layer.weight)]] = merge
            else:
                refused.setdefault(merge, []).append(f"{path!r} (adapter {active[0]!r})")
    if several:
        path, active = next(iter(several.items()))
        problems.append(f"{len(several)} LoRA layer{'s have' if len(several) > 1 else ' has'} "
                        f"several active adapters ({path!r}: "
                        f"{', '.join(repr(a) for a in active)}); merge_lora=True merges one: "
                        f"make one active (peft's model.set_adapter({active[0]!r})), or merge "
                        "them into one first (peft's add_weighted_adapter)")
    problems += [f"{reason}: {listed(where)}" for reason, where in refused.items()]
    keys = list(module.state_dict(keep_vars=True))
    copies, dropped = _modules_to_save(module, keys, aliases, problems)
    inside = [f"{p}." for p in layers]
    dropped |= {k for k in keys for p in inside
                if k.startswith(p) and not k.startswith(f"{p}base_layer.")}
    adapter = adapter_scope(module)
    stray = [k for k in keys if k not in dropped and adapter(k)]
    if stray:
        problems.append(f"{len(stray)} of the adapters' tensors outside any LoRA layer, which no "
                        f"merge puts in the base model: {listed([repr(k) for k in stray])}")
    if problems:
        raise ValueError(f"{call}: merge_lora=True cannot merge this model: "
                         + "; ".join(problems) + ". Export the adapter alone (adapter=True) or "
                         "the model as it is (merge_lora=False)")
    prefix = peft_prefix(module)
    entries, seen = [], {}
    for key in keys:
        if key in dropped:
            continue
        source = copies.get(key, aliases.get(key, key))
        name = base_name(key, prefix)
        if name in seen:  # not in a model PEFT made; a guard against a silent overwrite
            raise ValueError(f"{call}: merge_lora=True gives {key!r} and {seen[name]!r} the same "
                             f"name in the base model, {name!r}; export with merge_lora=False")
        seen[name] = key
        shape, held = shapes[source]
        entries.append(Entry(name, source, shape, output_dtype(held, dtype), merges.get(source)))
    return entries


def _merge_of(path: str, layer: nn.Module, adapter: str, names: dict[int, str],
              shapes: dict) -> Merge | str:
    """The merge of `layer`'s active `adapter`, or why it cannot be merged."""
    base = layer.base_layer
    if adapter in _held(layer, "lora_embedding_A") or not isinstance(base, nn.Linear):
        return (f"LoRA on {type(base).__name__}, where merge_lora=True merges LoRA on nn.Linear "
                "only")
    a, b = layer.lora_A[adapter] if adapter in _held(layer, "lora_A") else None, \
        layer.lora_B[adapter] if adapter in _held(layer, "lora_B") else None
    if not isinstance(a, nn.Linear) or not isinstance(b, nn.Linear):
        return (f"lora_A {type(a).__name__} and lora_B {type(b).__name__}, not the two "
                "nn.Linear of LoRA on nn.Linear")
    variant = getattr(layer, "lora_variant", None) or {}
    if adapter in variant or adapter in _held(layer, "lora_magnitude_vector"):
        kind = type(variant[adapter]).__name__ if adapter in variant else "DoRA"
        return f"a LoRA variant ({kind}), whose merge is not W + (B @ A) * scaling"
    if a.bias is not None or b.bias is not None:
        return "a bias in the adapter (lora_bias=True), which this merge does not add"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out=True (a transposed weight)"
    if getattr(layer, "merged_adapters", None):
        return ("adapters already merged into the base weight: unmerge them first (peft's "
                "model.unmerge_adapter())")
    scaling = getattr(layer, "scaling", None)
    if isinstance(scaling, Mapping):
        scaling = scaling.get(adapter)
    if isinstance(scaling, torch.Tensor) and scaling.numel() == 1:
        scaling = scaling.item()
    if not isinstance(scaling, numbers.Real) or isinstance(scaling, bool):
        return ("no scaling for the adapter (PEFT's LoraLayer holds lora_alpha / r in "
                "scaling[<adapter>], or a number in scaling)")
    w, first_a, first_b = (names[id(t)] for t in (base.weight, a.weight, b.weight))
    (w_shape, w_dtype), (a_shape, a_dtype), (b_shape, b_dtype) = (
        shapes[n] for n in (w, first_a, first_b))
    if len(w_shape) != 2 or a_shape != [a_shape[0], w_shape[1]] or \
            b_shape != [w_shape[0], a_shape[0]]:
        return (f"a base weight {tuple(w_shape)}, lora_A {tuple(a_shape)} and lora_B "
                f"{tuple(b_shape)}, not (out, in), (r, in) and (out, r)")
    dtype = torch.float32
    for d in (w_dtype, a_dtype, b_dtype):
        dtype = torch.promote_types(dtype, d)
    return Merge(path, first_a, first_b, float(scaling), dtype)


def _modules_to_save(module: nn.Module, keys: list[str], aliases: dict[str, str],
                     problems: list[str]) -> tuple[dict[str, str], set[str]]:
    """PEFT's `modules_to_save` wrappers in a merged export: each original module's key ->
    the active copy's tensor (the module `merge_and_unload()` keeps), and the copies' keys,
    left out."""
    copies, dropped = {}, set()
    for path, m in module.named_modules():
        if "original_module" not in m._modules or "modules_to_save" not in m._modules:
            continue
        held = _held(m, "modules_to_save")
        active = _active(m, held)
        if len(active) > 1:
            problems.append(f"{path!r} keeps a copy for each of several active adapters "
                            f"({', '.join(map(repr, active))}) in modules_to_save; make one "
                            "active")
            continue
        copy = f"{path}.modules_to_save."
        dropped |= {k for k in keys if k.startswith(copy)}
        if active:
            original = f"{path}.original_module."
            for key in keys:
                if key.startswith(original):
                    twin = f"{copy}{active[0]}.{key[len(original):]}"
                    if twin in keys:
                        copies[key] = aliases.get(twin, twin)
    return copies, dropped


def adapter_entries(call: str, keys: list[str], aliases: dict[str, str], shapes: dict, dtype,
                    adapter, configured=(), option: str = "adapter=") -> tuple[list, str]:
    """The entries of an adapter export (PEFT's keys, see `adapter_keys`), and the adapter's
    name: `adapter` itself when a str, else the one adapter that `keys` and `configured` (the
    `peft_config`'s names) hold. `option`: how the caller names the option in a message
    ("adapter=", or the command line's "--adapter ")."""
    found = list(dict.fromkeys([*adapter_names(keys), *configured]))

    def named(value) -> str:
        return f"{option}{value!r}" if option.endswith("=") else f"{option}{value}"
    if isinstance(adapter, str):
        if adapter not in found:
            raise ValueError(f"{call}: {named(adapter)} is not an adapter of this model; it "
                             f"has {', '.join(map(repr, found)) or 'none'}")
        name = adapter
    elif len(found) != 1:
        raise ValueError(
            f"{call}: {option.strip()}{'True' if option.endswith('=') else ''} exports the "
            "model's one adapter, and it has "
            + (f"{len(found)}: {', '.join(map(repr, found))}; name one, e.g. "
               f"{named(found[0])}" if found else
               "none (no lora_A/lora_B or modules_to_save in its names, as PEFT's "
               "get_peft_model makes them)"))
    else:
        name = found[0]
    chosen = adapter_keys(keys, name, [o for o in found if o != name])
    if not chosen:
        raise ValueError(f"{call}: the adapter {name!r} holds no tensor that PEFT saves (LoRA's "
                         "lora_A, lora_B, modules_to_save)")
    entries = []
    for out, key in chosen.items():
        source = aliases.get(key, key)
        shape, held = shapes[source]
        entries.append(Entry(out, source, shape, output_dtype(held, dtype)))
    return entries, name


def check_config(call: str, config) -> None:
    """Refuse what `adapter_keys` does not write as PEFT would: another method than LoRA, a
    bias saved with the adapter."""
    if config is None:
        return
    peft_type = _get(config, "peft_type")
    peft_type = getattr(peft_type, "value", peft_type)
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise ValueError(f"{call}: adapter=True writes LoRA adapters, and this one is {peft_type}; "
                         "save it with peft's save_pretrained on rank 0")
    bias = _get(config, "bias")
    if bias not in (None, "none"):
        raise ValueError(f"{call}: adapter=True writes LoRA adapters with bias='none', and this "
                         f"one has bias={bias!r} (which saves base biases beside it); save it "
                         "with peft's save_pretrained on rank 0")


def peft_config(module: nn.Module, adapter: str):
    """The model's `peft_config[adapter]` (on the PeftModel or its tuner), or None."""
    for holder in (module, module._modules.get("base_model")):
        configs = getattr(holder, "peft_config", None) if holder is not None else None
        if isinstance(configs, Mapping) and adapter in configs:
            return configs[adapter]
    return None


def configured(module: nn.Module) -> list[str]:
    """The adapters' names in the model's `peft_config`."""
    for holder in (module, module._modules.get("base_model")):
        configs = getattr(holder, "peft_config", None) if holder is not None else None
        if isinstance(configs, Mapping):
            return list(configs)
    return []


def _get(config, key):
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def adapter_config(module: nn.Module, adapter: str) -> dict | None:
    """What `save_pretrained` writes to adapter_config.json for `adapter`, or None when the
    model has no `peft_config` for it. PEFT's own config gives its `to_dict()`; another object
    its public attributes, with what the model shows filled in where it says nothing: r (the
    rank of lora_A), lora_alpha (scaling x r), target_modules (the LoRA layers' own names) and
    peft_type "LORA". As save_pretrained does (src/peft/peft_model.py, src/peft/config.py):
    sets as lists, inference_mode true, base_model_name_or_path from the base model's
    `name_or_path` when the config has none, and `auto_mapping` (the base model's class) when
    the config has no task_type."""
    config = peft_config(module, adapter)
    if config is None:
        return None
    if callable(getattr(config, "to_dict", None)):
        out = dict(config.to_dict())
    elif isinstance(config, Mapping):
        out = dict(config)
    else:
        out = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    layers = {p: m for p, m in lora_layers(module).items() if adapter in _held(m, "lora_A")}
    if layers:
        path, layer = next(iter(layers.items()))
        r = layer.lora_A[adapter].weight.shape[0]
        scaling = getattr(layer, "scaling", None)
        scaling = scaling.get(adapter) if isinstance(scaling, Mapping) else scaling
        out.setdefault("r", r)
        if isinstance(scaling, numbers.Real):
            out.setdefault("lora_alpha", scaling * r)
        out.setdefault("target_modules", sorted({p.rsplit(".", 1)[-1] for p in layers}))
    out.setdefault("peft_type", "LORA")
    base = module
    if peft_prefix(module):
        base = module._modules["base_model"]._modules["model"]
    if out.get("base_model_name_or_path") is None:
        out["base_model_name_or_path"] = base.__dict__.get("name_or_path") or None
    out["inference_mode"] = True
    if out.get("task_type") is None:
        out["auto_mapping"] = {"base_model_class": type(base).__name__,
                               "parent_library": type(base).__module__}
    return {k: _plain(v) for k, v in out.items()}


def _plain(value):
    """`value` as JSON holds it: an enum as its value, a set as a sorted list."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def write_config(directory: str, config: dict) -> None:
    """adapter_config.json in `directory`, as PEFT writes it (indent 2, keys sorted)."""
    write_text(os.path.join(directory, ADAPTER_CONFIG), json.dumps(config, indent=2,
                                                                   sort_keys=True))
    fsync_dir(directory)


@torch.no_grad()
def merged(start: int, values: torch.Tensor, cols: int, a: torch.Tensor, b: torch.Tensor,
           merge: Merge):
    """The piece of a base weight (`values`, its elements from `start` on, row-major with
    `cols` columns) merged: (start, W + (B @ A) * scaling) for each run of about ROWS
    elements (whole rows where a row is shorter), so what it makes beside the piece stays
    small."""
    # Small on purpose: merging 24 layers of 1024 x 1024 in runs of 1 MiB raised the resident
    # high-water mark by 6-12 MB (the allocator keeps freed blocks), in runs of 256 KiB by
    # about 2.5 MB.
    rows = ROWS
    n = values.numel()
    at = start
    per = max(rows // cols, 1) * cols
    while at < start + n:
        row = at // cols
        end = min(start + n, row * cols + per)
        delta = b[row:(end - 1) // cols + 1] @ a  # PEFT's get_delta_weight: (B @ A) * scaling
        delta = delta.reshape(-1)[at - row * cols:end - row * cols] * merge.scaling
        yield at, values[at - start:end - start].to(merge.dtype) + delta
        at = end
