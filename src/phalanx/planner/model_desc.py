"""What the planner knows about a model, from whichever description the user has.

Three sources, from least to most informative:
- a parameter count (`--params 8e9`): enough for model states and communication, not for
  activations;
- a Hugging Face style config (`--config config.json`): parameters, per-layer activations and
  FLOPs from the formulas in transformer.py;
- a module, or a factory `PATH:FUNCTION` that builds one: it is built on the meta device
  (shapes only, no memory), parameters are counted from it, and activations and FLOPs come
  from a traced forward (trace.py).
Every failure becomes a `ValueError` with one line that names the cause.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..engine.units import find_blocks, output_layer, resolve_block_classes
from .sizes import format_count, parse_count
from .transformer import TransformerShape, shape_from_config

__all__ = ["ModelDesc", "describe", "from_count", "from_config", "from_module", "from_factory"]


@dataclass
class ModelDesc:
    name: str
    source: str                      # "count", "config" or "module"
    params: int                      # unique parameters (tied weights once)
    trainable_params: int            # those with requires_grad: they get gradients and state
    trainable_shapes: list[tuple[int, ...]] | None  # module order; None for a bare count
    trainable_blocks: list | None = None  # the repeated block of each (None outside), if known
    # every parameter, frozen ones included (zero3 shards and gathers them with the trainable
    # ones, in the same units): module order, and the block of each; None for a bare count
    param_shapes: list[tuple[int, ...]] | None = None
    param_blocks: list | None = None
    param_trainable: list[bool] | None = None  # which of param_shapes learn, where known
    param_linear: list[bool] | None = None  # which of param_shapes a 4-bit base may store:
    # nn.Linear weights, the output layer's excepted
    transformer: TransformerShape | None = None
    module: nn.Module | None = None
    block_classes: tuple | None = None  # px.plan's `blocks=`, resolved (engine/units.py)
    # zero3's roots as a run's engine laid them out, [name, elements] (engine_roots in
    # engine/zero3_roots.py):
    # which units stay gathered from forward into backward, where a count cannot say
    zero3_roots: list | None = None
    make_input: Callable[[int, int], tuple] | None = None
    # what made parameters frozen, when the plan did (finetune.py): {"lora_rank": ...,
    # "lora_targets": [...], "adapter_params": ...} or {"trainable": fraction}
    finetune: dict | None = None
    # the share of the described model's own matrix weights that is frozen, where the FLOPs
    # come from a formula (a config): their weight gradients are not computed
    frozen_share: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def frozen_params(self) -> int:
        return self.params - self.trainable_params

    def summary(self) -> dict[str, Any]:
        out = {"name": self.name, "source": self.source, "params": self.params,
               "trainable_params": self.trainable_params}
        if self.finetune is not None:
            out["finetune"] = dict(self.finetune)
        if self.transformer is not None:
            out["transformer"] = self.transformer.to_dict()
        return out


def from_count(params) -> ModelDesc:
    n = parse_count(params)
    return ModelDesc(name=f"{format_count(n)} parameters", source="count", params=n,
                     trainable_params=n, trainable_shapes=None,
                     notes=["a bare parameter count gives no activations: pass --config or "
                            "--model to include them"])


def from_config(config) -> ModelDesc:
    """A config dict, or a path to a config.json."""
    source = "config"
    if isinstance(config, (str, os.PathLike)):
        source = str(config)
        try:
            with open(config) as f:
                config = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"config file {source} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"config file {source} is not valid JSON: {exc}") from None
        except OSError as exc:
            raise ValueError(f"cannot read config file {source}: {exc.strerror}") from None
    shape = shape_from_config(config, source)
    shapes = shape.param_shapes()
    name = shape.name if shape.name != "transformer" else os.path.basename(source)
    return ModelDesc(name=name, source="config", params=shape.params(),
                     trainable_params=shape.params(), trainable_shapes=shapes,
                     trainable_blocks=shape.param_blocks(), param_shapes=shapes,
                     param_blocks=shape.param_blocks(), param_trainable=[True] * len(shapes),
                     param_linear=shape.param_linear(), transformer=shape)


def _default_input(module: nn.Module) -> Callable[[int, int], tuple]:
    """Guess the input from the first layer that has parameters: token ids for an Embedding,
    features for a Linear. Anything else needs `input_shape`."""
    if callable(getattr(module, "example_input", None)):
        return lambda b, s: _as_tuple(module.example_input(b, s))
    first = next((m for m in module.modules()
                  if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, nn.Embedding):
        return lambda b, s: (torch.zeros(b, s, dtype=torch.long, device="meta"),)
    if isinstance(first, nn.Linear):
        return lambda b, s: (torch.zeros(b, first.in_features, device="meta"),)
    kind = type(first).__name__ if first is not None else "no parameters"
    raise ValueError(f"cannot guess the input of a model that starts with {kind}: give "
                     f"--input-shape (per sample, e.g. 3x224x224) or define "
                     f"example_input(batch_size, seq_len) on the module")


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def input_from_shape(spec, dtype: str = "float32") -> Callable[[int, int], tuple]:
    """'3x224x224' (per sample; 'seq' stands for --seq) -> a builder of a meta batch."""
    text = str(spec).lower().replace(",", "x").replace(" ", "")
    parts = [p for p in text.split("x") if p]
    if not parts or not all(p.isdigit() or p in ("seq", "s") for p in parts):
        raise ValueError(f"cannot read input shape {spec!r}: write the per-sample shape, e.g. "
                         f"3x224x224 or seq (token ids of length --seq)")
    dt = {"float32": torch.float32, "float": torch.float32, "long": torch.long,
          "int64": torch.long}.get(str(dtype).lower())
    if dt is None:
        raise ValueError(f"unknown input dtype {dtype!r}: use float32 or long")

    def make(b, s):
        dims = [s if p in ("seq", "s") else int(p) for p in parts]
        return (torch.zeros(b, *dims, dtype=dt, device="meta"),)
    return make


def _blocks_of(module: nn.Module, params, classes=None) -> list:
    """The repeated block (index) each parameter sits in, as the engine's units see it."""
    block_of = {}
    for b, block in enumerate(find_blocks(module, classes)):
        for p in block.parameters():
            block_of.setdefault(p, b)
    return [block_of.get(p) for p in params]


def from_module(module: nn.Module, name: str | None = None,
                make_input: Callable[[int, int], tuple] | None = None,
                blocks=None) -> ModelDesc:
    if not isinstance(module, nn.Module):
        raise ValueError(f"expected a torch.nn.Module, got {type(module).__name__}")
    classes = resolve_block_classes(module, blocks)
    params = list(module.parameters())  # unique: tied weights appear once
    trainable = [p for p in params if p.requires_grad]
    output = output_layer(module, classes)  # a 4-bit base leaves it (model/nf4_base.py)
    linear = {id(m.weight) for m in module.modules()
              if isinstance(m, nn.Linear) and m is not output}
    desc = ModelDesc(name=name or type(module).__name__, source="module",
                     params=sum(p.numel() for p in params),
                     trainable_params=sum(p.numel() for p in trainable),
                     trainable_shapes=[tuple(p.shape) for p in trainable],
                     trainable_blocks=_blocks_of(module, trainable, classes),
                     param_shapes=[tuple(p.shape) for p in params],
                     param_blocks=_blocks_of(module, params, classes),
                     param_trainable=[p.requires_grad for p in params],
                     param_linear=[id(p) in linear for p in params], module=module,
                     block_classes=classes)
    try:
        desc.make_input = make_input or _default_input(module)
    except ValueError as exc:
        desc.notes.append(f"activations not traced: {exc}")
    return desc


def _load_factory(spec: str) -> Callable[[], nn.Module]:
    path, sep, func = str(spec).rpartition(":")
    if not sep or not path or not func:
        raise ValueError(f"--model {spec!r} must be PATH:FUNCTION, e.g. models.py:build or "
                         f"mypackage.models:build")
    try:
        if path.endswith(".py") or os.sep in path:
            if not os.path.isfile(path):
                raise ValueError(f"model file {path} does not exist")
            name = "_phalanx_plan_" + os.path.splitext(os.path.basename(path))[0]
            spec_ = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec_)
            sys.modules[name] = mod  # dataclasses and pickling look modules up by name
            spec_.loader.exec_module(mod)
        else:
            mod = importlib.import_module(path)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise ValueError(f"cannot import {path}: {type(exc).__name__}: {exc}") from None
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise ValueError(f"{path} has no function {func!r}")
    return fn


def from_factory(factory, make_input=None, blocks=None) -> ModelDesc:
    """`factory` is 'PATH:FUNCTION' or a callable; it is called with no arguments on the meta
    device, so even a 70B model costs no memory to describe."""
    name = factory if isinstance(factory, str) else getattr(factory, "__name__", "factory")
    fn = _load_factory(factory) if isinstance(factory, str) else factory
    try:
        with torch.device("meta"):
            module = fn()
    except Exception as exc:  # noqa: BLE001 - report the factory's own error in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(f"model factory {name} failed: {type(exc).__name__}: {first}") from None
    if not isinstance(module, nn.Module):
        raise ValueError(f"model factory {name} returned {type(module).__name__}, "
                         f"not a torch.nn.Module")
    return from_module(module, name=str(name), make_input=make_input, blocks=blocks)


def describe(model=None, *, params=None, config=None, make_input=None, blocks=None) -> ModelDesc:
    """Whichever one description was given -> a ModelDesc. `blocks`: the repeated blocks' classes
    (or names), as px.prepare takes them; for a module or factory only."""
    given = [x for x in (model, params, config) if x is not None]
    if len(given) != 1:
        raise ValueError("describe the model once: a parameter count (--params), a config "
                         "(--config) or a module factory (--model PATH:FUNCTION)")
    if params is not None:
        return from_count(params)
    if config is not None:
        return from_config(config)
    if isinstance(model, ModelDesc):
        if blocks is not None:  # its units were laid out when it was described
            raise ValueError("blocks goes where the model is described: "
                             "describe(module, blocks=...), then plan that description")
        return model
    if isinstance(model, nn.Module):
        return from_module(model, make_input=make_input, blocks=blocks)
    if isinstance(model, dict):
        return from_config(model)
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return from_count(model)
    if isinstance(model, (str, os.PathLike)):
        text = str(model)
        if text.endswith(".json"):
            return from_config(text)
        if ":" in text:
            return from_factory(text, make_input=make_input, blocks=blocks)
        return from_count(text)
    if callable(model):
        return from_factory(model, make_input=make_input, blocks=blocks)
    raise ValueError(f"cannot plan for a model given as {type(model).__name__}: pass a module, "
                     f"a factory, a config or a parameter count")
