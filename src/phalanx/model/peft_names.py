"""A PEFT-wrapped model against its base model: what its tensors are named in the base model's
files, which of its parameters are adapters, and how `get_peft_model` draws those.

[Note: a PEFT model reads the plain model's files]
`get_peft_model(base, config)` renames the base's tensors: `base_model.model.` in front (a
LoRA-like tuner; `base_model.` for prompt learning, whose wrapper holds the base itself), and
inside each adapted layer the original module as `base_layer` (`q_proj.weight` becomes
`q_proj.base_layer.weight`), or, for `modules_to_save`, as `original_module` beside a copy in
`modules_to_save.<adapter>`. The files were written by the plain model, so `file_names`
undoes that wrapping (a rule on those components, whatever the model's own names), and
model/pretrained.py reads a state_dict key from the first of its names that the files have.
A parameter is an adapter's, and in no file, when it lies in a tuner layer (a module with a
`base_layer`) outside that base layer, or in a PEFT wrapper (a module with a `base_model`)
outside its base model (`adapter_scope`). Built on meta, it is drawn as a whole build draws it
(`draw_order`): every module holding one runs its `reset_parameters()`, and then each LoRA
layer PEFT's own `reset_lora_parameters(adapter, init_lora_weights)` (A drawn as nn.Linear
draws, B zero), in `model.modules()` order, from rank 0's generator, on CPU temporaries copied
into the parameters (zero3: into the pieces each rank owns), as
[Note: only the shards are kept] in model/materialize.py draws a meta build. From the same
generator state that is the values `get_peft_model` gives a whole model, draw for draw. An
adapter that nothing draws, or a LoRA initialisation that reads the base weights (PiSSA,
OLoRA, ...: PEFT computes those when the adapter is made, from a base that a meta build does
not have yet), is refused.

The two routes of a meta build draw the adapters alike. With `init=px.from_safetensors(...)`
the base is read and only the adapters are drawn (model/pretrained.py; not on meta, an adapter
keeps its values, rank 0's). With no `init=`, `get_peft_model` wraps a base already built, so
a whole build draws the base first and the adapters after it: the meta build draws every
module's `reset_parameters()` in `model.modules()` order with the adapters' parameters left
out, then the adapters in the order above (`plain_draws` in model/materialize.py). Module by
module alone, the adapters would be drawn between the base's layers, and LoRA's B would keep
nn.Linear's random values instead of PEFT's zeros.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from .consistency import broadcast_tensors

__all__ = ["file_names", "adapter_scope", "adapters", "Adapters", "draw_order", "draw_calls",
           "ancestors", "listed", "peft_prefix", "base_name", "adapter_names", "adapter_keys"]

# What get_peft_model puts in front of the base's names (a tuner's LoraModel and the model;
# prompt learning's model alone), the components it puts inside them, and what PEFT's LoRA
# initialisation sets in a LoRA layer.
_PEFT_PREFIXES = ("base_model.model.", "base_model.")
_PEFT_INSIDE = ("base_layer", "original_module")
_PEFT_COPIES = "modules_to_save"  # followed by the adapter's name
_LORA_INIT_SETS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
_LORA_INITS = (True, False, "gaussian")  # drawn alone; the others read the base weights


def file_names(name: str) -> list[str]:
    """`name` (a state_dict key), then the names the plain model gives it if PEFT wrapped the
    model: each prefix of `_PEFT_PREFIXES` it starts with taken off, then without any."""
    out = [name]
    for prefix in _PEFT_PREFIXES:
        if name.startswith(prefix):
            out.append(_unwrapped(name[len(prefix):]))
    out.append(_unwrapped(name))
    return list(dict.fromkeys(out))


def _unwrapped(name: str) -> str:
    """`name` without what PEFT puts inside a wrapped layer: `base_layer` and
    `original_module`, and `modules_to_save.<adapter>` (the copy holds the original's values
    before training). The last component, the tensor's own name, stays."""
    parts, kept = name.split("."), []
    i = 0
    while i < len(parts) - 1:
        if parts[i] == _PEFT_COPIES:
            i += 2
            continue
        if parts[i] not in _PEFT_INSIDE:
            kept.append(parts[i])
        i += 1
    return ".".join(kept + parts[i:])


def adapter_scope(model: nn.Module):
    """name -> whether a state_dict key lies in an adapter: in a tuner layer (a module with a
    `base_layer`) outside that base layer, or in a PEFT wrapper (a module with a `base_model`)
    outside its base model."""
    insides = [(path, "base_layer") for path, m in model.named_modules()
               if "base_layer" in m._modules] + \
        [(path, "base_model") for path, m in model.named_modules() if "base_model" in m._modules]

    def adapter(name: str) -> bool:
        for path, inside in insides:
            prefix = f"{path}." if path else ""
            if name.startswith(prefix) and not name.startswith(f"{prefix}{inside}."):
                return True
        return False
    return adapter


def adapters(model: nn.Module) -> list[tuple[str, str]]:
    """The adapters' parameters of `model` (those all of whose names `adapter_scope` says are
    an adapter's), each as (module path, attribute) of the module that registers it first;
    none for a model PEFT did not wrap."""
    adapter = adapter_scope(model)
    names: dict[int, list[str]] = {}
    first: dict[int, tuple[str, str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append(f"{path}.{attr}" if path else attr)
                first.setdefault(id(p), (path, attr))
    return [first[i] for i, held in names.items() if all(map(adapter, held))]


@dataclass
class Adapters:
    """The adapters' parameters of a PEFT model that no file has, each as (module path,
    attribute) from `root`: `drawn` on meta, by `order` ((module path, "reset" or "lora");
    `inits`: each LoRA layer's adapters and their `init_lora_weights`), or `kept` (not on meta)
    with the values the model holds. Found by model/pretrained.py's `plan`."""
    root: nn.Module
    drawn: list[tuple[str, str]]
    kept: list[tuple[str, str]]
    order: list[tuple[str, str]]
    inits: dict[str, dict]

    @classmethod
    def of(cls, model: nn.Module, lacking: list[tuple[str, str]], problems: list[str]
           ) -> Adapters:
        """The adapters' parameters `lacking` (those no file has), drawn if on meta."""
        drawn = [(path, attr) for path, attr in lacking
                 if model.get_submodule(path)._parameters[attr].is_meta]
        kept = [key for key in lacking if key not in drawn]
        return cls(model, drawn, kept, *draw_order(model, drawn, problems))

    def draws(self) -> tuple[list, set]:
        """What draws them, as model/materialize.py's `draw_modules` takes it: the calls in
        order, and the (module, attribute) of the parameters drawn."""
        return draw_calls(self.root, self.order, self.inits), \
            {(self.root.get_submodule(path), attr) for path, attr in self.drawn}

    @torch.no_grad()
    def share_kept(self, comm) -> None:
        """Rank 0's values of the adapters' parameters that were not on meta (each rank may
        have drawn its own), on every rank."""
        if self.kept and comm is not None and comm.world > 1:
            broadcast_tensors([self.root.get_submodule(path)._parameters[attr].data
                               for path, attr in self.kept], comm, tag="prepare:adapters kept")


def draw_order(model: nn.Module, drawn: list[tuple[str, str]], problems: list[str], *,
               keep_undrawn: bool = False) -> tuple[list[tuple[str, str]], dict[str, dict]]:
    """What draws the adapters' parameters `drawn` ((module path, attribute) each), in the
    order a whole build draws them (see [Note: a PEFT model reads the plain model's files]):
    (module path, "reset") for each module holding one, which runs its `reset_parameters()`,
    and (LoRA layer path, "lora") for each LoRA layer over one, once its modules have; and
    each LoRA layer's adapters and their `init_lora_weights`. What nothing draws (left as it
    is with `keep_undrawn`), and an initialisation of PEFT's that reads the base weights, are
    `problems`."""
    if not drawn:
        return [], {}
    lora = {path: m for path, m in model.named_modules() if "base_layer" in m._modules
            and callable(getattr(m, "reset_lora_parameters", None))}
    under, undrawn = {}, {}  # a parameter's module -> the LoRA layer whose initialisation sets it
    for holder, attr in drawn:
        for path in lora:
            if any(holder == f"{path}.{c}" or holder.startswith(f"{path}.{c}.")
                   for c in _LORA_INIT_SETS):
                under[holder] = path
        module = model.get_submodule(holder)
        if holder not in under and not callable(getattr(module, "reset_parameters", None)):
            undrawn[f"{holder}.{attr}" if holder else attr] = type(module).__name__
    holders = {path for path, _ in drawn}
    if undrawn and not keep_undrawn:
        problems.append(
            f"{len(undrawn)} of the adapters' parameters in no file and on the meta device that "
            f"nothing draws: {listed([repr(n) for n in undrawn])} "
            f"({', '.join(dict.fromkeys(undrawn.values()))} has no reset_parameters(), and "
            "PEFT's LoRA initialisation does not set it). Build the model off the meta device "
            "(its adapters then keep their values), or give that module a reset_parameters()")
    inits = _lora_inits(model, lora, dict.fromkeys(under.values()), problems)
    order, waiting = [], []  # a LoRA layer's initialisation waits for its modules' resets
    for path, module in model.named_modules():
        while waiting and not path.startswith(waiting[-1] + "."):
            order.append((waiting.pop(), "lora"))
        if path in holders and callable(getattr(module, "reset_parameters", None)):
            order.append((path, "reset"))
        if path in inits:
            waiting.append(path)
    order.extend((path, "lora") for path in reversed(waiting))
    return order, inits


def _lora_inits(model: nn.Module, lora: dict, paths, problems: list[str]) -> dict[str, dict]:
    """Each LoRA layer of `paths`: its adapters and their `init_lora_weights`, from the PEFT
    configuration above it. One that reads the base weights is a problem."""
    inits: dict[str, dict] = {}
    unsupported = []
    for path in paths:
        module, config = lora[path], _peft_config(model, path)
        names = [n for c in _LORA_INIT_SETS
                 for n in getattr(getattr(module, c, None), "keys", lambda: [])()]
        inits[path] = {}
        for name in dict.fromkeys(names):
            init = getattr(config.get(name), "init_lora_weights", True)
            if not any(init is i or (isinstance(init, str) and isinstance(i, str)
                                     and init.lower() == i) for i in _LORA_INITS):
                unsupported.append((name, path, init))
            inits[path][name] = init
    if unsupported:
        name, path, init = unsupported[0]
        problems.append(
            f"the LoRA adapter {name!r} of {path!r} is initialised with "
            f"init_lora_weights={init!r}" + (f" (and {len(unsupported) - 1} more)"
                                              if len(unsupported) > 1 else "") +
            ", which PEFT computes from the base weights when the adapter is made, and a model "
            "built on the meta device has none then: build the model off the meta device for "
            "that initialisation, or use init_lora_weights=True or 'gaussian'")
    return inits


def draw_calls(model: nn.Module, order: list[tuple[str, str]], inits: dict[str, dict]) -> list:
    """`draw_order`'s draws as model/materialize.py's `draw_modules` runs them: (module path,
    module, fn, what fn is called), in order."""
    calls = []
    for path, how in order:
        module = model.get_submodule(path)
        if how == "reset":
            calls.append((path, module, module.reset_parameters, "reset_parameters()"))
        else:
            calls.append((path, module, functools.partial(_lora_init, module, inits[path]),
                          "reset_lora_parameters()"))
    return calls


def _peft_config(model: nn.Module, path: str) -> dict:
    """The `peft_config` ({adapter: config}) of the nearest module above `path` with one, as
    PEFT's models hold it; {} when none does (PEFT's defaults)."""
    for a in ancestors(path):
        config = getattr(model.get_submodule(a), "peft_config", None)
        if isinstance(config, dict):
            return config
    return {}


def _lora_init(module: nn.Module, inits: dict) -> None:
    """PEFT's own initialisation of each adapter of a LoRA layer, with its
    `init_lora_weights` (True: A as nn.Linear draws it, B zero; False: nothing)."""
    for name, init in inits.items():
        module.reset_lora_parameters(name, init)


def ancestors(path: str) -> list[str]:
    """The module path `path` itself, then each module above it, up to the root ("")."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def listed(names: list[str], most: int = 8) -> str:
    """`names` joined for a message, the first `most` of them."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


# -- the names of an export (checkpoint/lora.py) --------------------------------------------------
# What holds an adapter's tensors under the adapter's name in a PEFT model's state_dict keys
# (`q_proj.lora_A.default.weight`, `lm_head.modules_to_save.default.weight`).
_ADAPTER_HOLDERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                    "lora_magnitude_vector", _PEFT_COPIES)


def peft_prefix(model: nn.Module) -> str:
    """What `get_peft_model` put in front of the base model's names in `model`'s state_dict:
    `base_model.model.` for a PeftModel over a tuner (LoRA's LoraModel holds the base as
    `model`), else nothing (a model PEFT did not wrap, or one `inject_adapter_in_model` changed
    in place)."""
    wrapper = model._modules.get("base_model")
    return "base_model.model." if wrapper is not None and "model" in wrapper._modules else ""


def base_name(name: str, prefix: str) -> str:
    """`name`, a state_dict key of a PEFT model whose keys start with `prefix` (`peft_prefix`),
    as the base model names it: the prefix taken off, then `base_layer`, `original_module` and
    `modules_to_save.<adapter>` (what `merge_and_unload()` takes away)."""
    return _unwrapped(name[len(prefix):] if prefix and name.startswith(prefix) else name)


def adapter_names(names) -> list[str]:
    """The adapters' names in the state_dict keys `names`, in order of first appearance: each
    component right after `lora_A`, `lora_B`, ..., `modules_to_save`."""
    found = []
    for name in names:
        parts = name.split(".")
        found += [parts[i + 1] for i in range(len(parts) - 1) if parts[i] in _ADAPTER_HOLDERS]
    return list(dict.fromkeys(found))


def adapter_keys(names, adapter: str, others) -> dict[str, str]:
    """The LoRA adapter `adapter` of the state_dict keys `names`, as PEFT saves it: {key in
    adapter_model.safetensors: key in the model}. PEFT's `get_peft_model_state_dict`
    (src/peft/utils/save_and_load.py, with a LoRA config's default bias="none") drops the keys
    of the other adapters (`.<other>.` in the key, or at its end), keeps those holding "lora_",
    puts the copy of a module in `modules_to_save` under the wrapper's own name (`lm_head.
    modules_to_save.default.weight` -> `lm_head.weight`, as ModulesToSaveWrapper's
    `adapter_state_dict` answers), and takes the adapter's name out (`q_proj.lora_A.default.
    weight` -> `q_proj.lora_A.weight`; DoRA's `lora_magnitude_vector.default.weight` ->
    `lora_magnitude_vector`)."""
    out: dict[str, str] = {}
    for name in names:
        if any(f".{o}." in name or name.endswith(f".{o}") for o in others):
            continue
        parts = name.split(".")
        if _PEFT_COPIES in parts[:-1]:
            i = parts.index(_PEFT_COPIES)
            if parts[i + 1] == adapter:
                out[".".join(parts[:i] + parts[i + 2:])] = name
        elif "lora_" in name:
            out[_without_adapter(name, adapter)] = name
    return out


def _without_adapter(name: str, adapter: str) -> str:
    """PEFT's `remove_adapter_name` (in get_peft_model_state_dict) of a LoRA key."""
    if name.endswith(f"lora_magnitude_vector.{adapter}.weight"):
        name = name[:-len(".weight")]  # DoRA's vector is saved as the parameter it once was
    if name.endswith(f".{adapter}"):
        return name[:-len(adapter) - 1]
    head, _, last = name.rpartition(".")
    if head.endswith(f".{adapter}"):
        head = head[:-len(adapter) - 1]
    return f"{head}.{last}"
