"""Lightning's checkpoints as phalanx checkpoints.

A checkpoint that the Trainer (`ModelCheckpoint`, `trainer.save_checkpoint`) or Fabric
(`fabric.save`) writes under `PhalanxStrategy` is a phalanx checkpoint directory, written by
`px.save` on every rank: the model's weights and the optimizer's state as each rank holds
them (zero3's shards stay shards), and Lightning's own state beside them as one plain value:
under the key "lightning" the Trainer's dictionary less its "state_dict" and
"optimizer_states" (loops, callbacks, schedulers, hyper-parameters...), under "fabric" the
other entries of Fabric's state. So `px.load(path, model=model)` reads one at any world size
and under any strategy, and `phalanx export` turns it into a safetensors file.

Loading leaves the random generators as they were: Lightning saves none and restores none,
and a script seeded with `seed_everything` draws after a resume what it drew under
DDPStrategy (px.load alone would restore each rank's generators as they were at the save).

`trainer.fit(ckpt_path=...)` also takes a checkpoint *file* that Lightning wrote under another
strategy (DDPStrategy's `.ckpt`): its "state_dict" and "optimizer_states" are loaded through
the prepared model's and optimizer's `load_state_dict`, which phalanx accepts in one
process's format under every strategy.

[Note: load_from_checkpoint of a checkpoint directory]
`LightningModule.load_from_checkpoint(path)` (a classmethod: no Trainer, no strategy, often a
process of its own) reads `path` through `pl_load` in `lightning.pytorch.core.saving`, which
opens it as a file for `torch.load`: on a phalanx directory that raised IsADirectoryError.
Lightning has no hook for another format there (its CheckpointIO plugins serve a Trainer's
strategy, not this classmethod), so importing the integration puts `read_directories` in front
of that function, in that module alone: a directory holding phalanx's manifest.json is read by
`lightning_dictionary` in this process (every rank's shards joined, on the CPU), and anything
else goes to Lightning's own reader unchanged. Considered and set aside: a function of ours to
call instead leaves the Lightning call failing where users call it; a Trainer checkpoint
written as one file would give up the format every rank writes its own share of.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil

import lightning
import numpy as np
import torch

import phalanx as px

from ...checkpoint import wait_for_saves
from ...checkpoint.api import full_weights
from ...checkpoint.common import STATE_FILE
from ...checkpoint.reader import MANIFEST
from .optimizer import prepared_optimizer
from .pending import prepared_module

__all__ = ["save_trainer", "load_trainer", "save_fabric", "load_fabric", "remove",
           "lightning_dictionary", "read_directories", "read_directories_in_lightning"]

TRAINER_KEY = "lightning"
FABRIC_KEY = "fabric"


def save_trainer(checkpoint: dict, path, model, optimizers: list) -> None:
    """`px.save` of the Trainer's `checkpoint` dictionary (a collective)."""
    checkpoint = dict(checkpoint)
    checkpoint.pop("state_dict", None)  # the model: saved by px.save below
    with_optimizer = checkpoint.pop("optimizer_states", None) is not None
    optimizer = optimizers[0] if with_optimizer and optimizers else None
    px.save(path, model=model, optimizer=optimizer, **{TRAINER_KEY: checkpoint})


def load_trainer(path, model, optimizers: list, fitting: bool, strict: bool,
                 checkpoint_io) -> dict:
    """Restore the model (and, when fitting, the optimizer) from `path` in place; return the
    rest of the Trainer's dictionary, for Lightning to restore loops, callbacks, schedulers."""
    optimizer = optimizers[0] if fitting and optimizers else None
    if os.path.isfile(path):  # a .ckpt written by Lightning under another strategy
        return _load_lightning_file(path, model, optimizer, strict, checkpoint_io)
    with _generators_kept():
        values = px.load(path, model=model, optimizer=optimizer, strict=strict)
    if TRAINER_KEY not in values:
        raise ValueError(
            f"{os.fspath(path)!r} is a phalanx checkpoint, but not one a Trainer wrote (it "
            f"holds {sorted(values) or 'no values'}); load its weights with "
            "px.load(path, model=model) before trainer.fit, without ckpt_path")
    return values[TRAINER_KEY]


def _load_lightning_file(path, model, optimizer, strict: bool, checkpoint_io) -> dict:
    checkpoint = checkpoint_io.load_checkpoint(path)
    model.load_state_dict(checkpoint.pop("state_dict"), strict=strict)
    states = checkpoint.pop("optimizer_states", None)
    if optimizer is not None and states:
        optimizer.load_state_dict(states[0])
    return checkpoint


def _split(state: dict) -> tuple:
    """Fabric's state as (model key, model, optimizer key, optimizer, the other entries)."""
    modules = [k for k, v in state.items() if isinstance(v, torch.nn.Module)]
    optimizers = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    if len(modules) > 1 or len(optimizers) > 1:
        raise ValueError(
            "PhalanxStrategy saves one model and one optimizer per checkpoint (px.save); this "
            f"state holds the models {modules} and the optimizers {optimizers}: save each "
            "model with its optimizer to a checkpoint of its own")
    if optimizers and not modules:
        raise ValueError("PhalanxStrategy stores an optimizer's state by its model's parameter "
                         "names: put the model in the state too")
    model_key = modules[0] if modules else None
    optim_key = optimizers[0] if optimizers else None
    rest = {k: v for k, v in state.items() if k not in (model_key, optim_key)}
    model = prepared_module(state[model_key]) if model_key is not None else None
    optimizer = prepared_optimizer(state[optim_key]) if optim_key is not None else None
    return (model_key, model, optim_key, optimizer, rest)


def save_fabric(path, state: dict) -> None:
    """`px.save` of Fabric's `state` (a collective); stateful entries by their state_dict()."""
    model_key, model, optim_key, optimizer, rest = _split(state)
    plain = {k: v.state_dict() if _stateful(v) else v for k, v in rest.items()}
    px.save(path, model=model, optimizer=optimizer,
            **{FABRIC_KEY: {"model": model_key, "optimizer": optim_key, "state": plain}})


def load_fabric(path, state, strict: bool) -> dict:
    """Restore Fabric's `state` (a dict, or a lone model) from `path` in place; return what
    was saved but not asked for."""
    if isinstance(state, torch.nn.Module):
        with _generators_kept():
            px.load(path, model=prepared_module(state), strict=strict)
        return {}
    if not state:
        raise ValueError("PhalanxStrategy restores a checkpoint into the objects it was saved "
                         "from: fabric.load(path, {'model': model, 'optimizer': optimizer, "
                         "...}); the weights alone: fabric.load(path, model)")
    if isinstance(state, torch.optim.Optimizer):
        raise TypeError("PhalanxStrategy loads an optimizer together with its model: "
                         "fabric.load(path, {'model': model, 'optimizer': optimizer})")
    _, model, _, optimizer, rest = _split(state)
    with _generators_kept():
        values = px.load(path, model=model, optimizer=optimizer, strict=strict)
    saved = values.get(FABRIC_KEY, {}).get("state", {})
    missing = [k for k in rest if k not in saved]
    if missing and strict:
        raise KeyError(f"the checkpoint {os.fspath(path)!r} holds no {missing[0]!r} (it has "
                       f"{sorted(saved)}); load with strict=False to leave it out")
    for key, obj in rest.items():
        if key not in saved:
            continue
        if _stateful(obj):
            obj.load_state_dict(saved[key])
        else:
            state[key] = saved[key]
    return {k: v for k, v in saved.items() if k not in rest}


@contextlib.contextmanager
def _generators_kept():
    """This process's random generators (CPU, this GPU's, Python's, NumPy's) as they were
    before the block (see the module docstring)."""
    cpu, python, numpy = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        random.setstate(python)
        np.random.set_state(numpy)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def _stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))


def remove(path, is_global_zero: bool, checkpoint_io) -> None:
    """Remove a checkpoint `ModelCheckpoint` no longer keeps: a directory px.save wrote (rank 0
    removes it), else through Lightning's checkpoint_io."""
    if os.path.isdir(path):
        if is_global_zero and os.path.isfile(os.path.join(path, "manifest.json")):
            shutil.rmtree(path)
        return
    if is_global_zero:
        checkpoint_io.remove_checkpoint(path)


# -- LightningModule.load_from_checkpoint ----------------------------------------------------
def lightning_dictionary(path, map_location=None, weights_only: bool | None = None) -> dict:
    """What `load_from_checkpoint` reads from a Lightning `.ckpt` file, read from the phalanx
    checkpoint directory `path` in this process alone (no process group): the model's full
    weights under "state_dict", every rank's shards joined, on the CPU (or on map_location
    where it names a device), and, where a Trainer wrote it, the other entries of the
    Trainer's dictionary (hyper_parameters, the loops', callbacks' and schedulers' states),
    unpickled as px.load unpickles them. `weights_only=True` unpickles nothing: the weights
    alone, from the safetensors files (the hyper-parameters are then the module's defaults or
    those given to load_from_checkpoint). See [Note: load_from_checkpoint of a checkpoint
    directory]."""
    wait_for_saves()  # a background save of this very checkpoint may still be running
    path = os.path.abspath(os.fspath(path))
    weights = full_weights(path)
    if isinstance(map_location, (str, torch.device)):
        weights = {name: value.to(map_location) for name, value in weights.items()}
    checkpoint = {}
    if not weights_only:  # state.pt holds NumPy's generator state: no weights_only=True load
        small = torch.load(os.path.join(path, STATE_FILE), map_location="cpu",
                           weights_only=False)
        checkpoint = dict(small["values"].get(TRAINER_KEY, {}))
    checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)
    checkpoint["state_dict"] = weights
    return checkpoint


def read_directories(load):
    """Lightning's checkpoint reader `load`, which also reads phalanx checkpoint directories."""

    @functools.wraps(load)
    def read(path_or_url, map_location=None, weights_only=None):
        if isinstance(path_or_url, (str, os.PathLike)) and \
                os.path.isfile(os.path.join(path_or_url, MANIFEST)):
            return lightning_dictionary(path_or_url, map_location, weights_only)
        return load(path_or_url, map_location=map_location, weights_only=weights_only)

    read.reads_phalanx_directories = True
    return read


def read_directories_in_lightning() -> None:
    """Put `read_directories` in front of the reader of Lightning's `load_from_checkpoint`
    (see [Note: load_from_checkpoint of a checkpoint directory]); once per process."""
    from lightning.pytorch.core import saving

    load = getattr(saving, "pl_load", None)
    if load is not None and not getattr(load, "reads_phalanx_directories", False):
        saving.pl_load = read_directories(load)
