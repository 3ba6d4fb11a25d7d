"""`px.save`, `px.load`, `px.latest_checkpoint` and `px.export`."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid
import warnings

import numpy as np
import torch

from ..collectives import Comm, default_comm
from .files import file_digest, fsync_dir, write_tensors
from .reader import MANIFEST, FORMAT, CheckpointError, Reader, read_manifest, verify_files
from .state import ModelState, OptimizerState

__all__ = ["save", "load", "latest_checkpoint", "export", "export_checkpoint", "CheckpointError"]

STATE_FILE = "state.pt"  # rank 0's small state: stateful objects, values, RNG, optimizer groups
LOSS_SCALER = "model.loss_scaler"  # where a prepared fp16 model's loss scaler is kept


def _is_stateful(value) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


def _agree(comm: Comm, error: str | None, what: str) -> None:
    """Raise on every rank if any rank had an error, naming the ranks and their errors."""
    errors = comm.all_gather_object(error, tag=what)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise CheckpointError(f"{what} failed ({detail})")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- save -------------------------------------------------------------------------------------
def save(path, model=None, optimizer=None, keep_last: int | None = None, **values) -> str:
    """Save a checkpoint to the directory `path`; a collective: every rank calls it.

    Each rank writes what it holds (its shards, and its share of what every rank holds whole)
    to its own file, in parallel; rank 0 adds the small state and, last, the manifest. The
    checkpoint is written under a temporary name and renamed when complete, so a crash at any
    moment leaves the previous checkpoint as it was. A keyword value is saved through its
    `state_dict()` when it has `state_dict`/`load_state_dict` (a sampler, a scheduler), else
    as a plain picklable value (rank 0's). With `keep_last=k`, only the k newest complete
    checkpoints in `path`'s parent directory are kept. Returns `path`.
    """
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"px.save(keep_last={keep_last!r}): keep_last is the number of "
                         "checkpoints to keep, 1 or more (or None to keep all)")
    model_state = ModelState(model) if model is not None else None
    comm = model_state.comm if model_state is not None else default_comm()
    optim_state = OptimizerState(optimizer, model_state) \
        if optimizer is not None and model_state is not None else None
    if optimizer is not None and model_state is None:
        raise ValueError("px.save(optimizer=...) needs model= too: the optimizer's state is "
                         "stored by the names of the model's parameters")
    path = os.path.abspath(os.fspath(path))
    token = comm.all_gather_object(uuid.uuid4().hex[:12], tag="save:token")[0]
    partial = f"{path}.partial-{token}"
    rank, world = comm.rank, comm.world
    own_file = f"rank{rank:05d}.safetensors"

    # 1. every rank writes its file
    report, error = None, None
    try:
        os.makedirs(partial, exist_ok=True)
        ranges, index, whole, keys = [], [], {}, {}
        if model_state is not None:
            owner = model_state.writer_of()
            ranges += model_state.ranges(owner)
            if optim_state is not None:
                optim_ranges, whole = optim_state.ranges(owner)
                ranges += optim_ranges
                for r in optim_ranges:
                    param, key = r.name[len("optim/"):].rsplit("/", 1)
                    keys.setdefault(param, set()).add(key)
        tensors = {}
        for r in ranges:
            key = f"{r.name}@{r.start}"
            tensors[key] = r.values
            index.append((r.name, own_file, key, r.start, r.end, str(r.values.dtype)[6:]))
        info = write_tensors(os.path.join(partial, own_file), tensors)
        report = {"file": own_file, "info": info, "index": index, "whole": whole,
                  "keys": {k: sorted(v) for k, v in keys.items()}, "rng": _rng_state()}
    except Exception as exc:  # reported on every rank below, then raised
        error = f"{type(exc).__name__}: {exc}"
    try:
        _agree(comm, error, f"px.save({path!r}): writing the ranks' files")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    reports = comm.gather_object(report, dst=0, tag="save:reports")

    # 2. rank 0 writes the small state and the manifest, then makes the checkpoint visible
    error = None
    if rank == 0:
        try:
            _finish_save(path, partial, reports, model_state, optim_state, values, keep_last,
                         world)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            shutil.rmtree(partial, ignore_errors=True)
    _agree(comm, error, f"px.save({path!r}): completing the checkpoint")
    return path


def _finish_save(path, partial, reports, model_state, optim_state, values, keep_last, world):
    files = {r["file"]: r["info"] for r in reports}
    small = {"values": {}, "stateful": {}, "rng": [r["rng"] for r in reports]}
    for name, value in values.items():
        if _is_stateful(value):
            small["stateful"][name] = value.state_dict()
        else:
            small["values"][name] = value
    if model_state is not None and model_state.prepared is not None:
        scaler = model_state.prepared.loss_scaler
        if scaler is not None:
            small["stateful"][LOSS_SCALER] = scaler.state_dict()
    if optim_state is not None:
        whole = {}
        for r in reports:
            whole.update(r["whole"])
        keys = {}
        for r in reports:
            for name, ks in r["keys"].items():
                keys.setdefault(name, set()).update(ks)
        small["optimizer"] = {"hyperparameters": optim_state.hyperparameters(),
                              "group_names": optim_state.group_names, "whole": whole,
                              "keys": {k: sorted(v) for k, v in keys.items()}}
    state_path = os.path.join(partial, STATE_FILE)
    with open(state_path, "wb") as f:
        torch.save(small, f)
        f.flush()
        os.fsync(f.fileno())
    files[STATE_FILE] = {"bytes": os.path.getsize(state_path), "sha256": file_digest(state_path)}

    tensors = {}
    if model_state is not None:
        for name, (shape, dtype) in model_state.shapes().items():
            tensors[f"model/{name}"] = {"shape": shape, "dtype": str(dtype)[6:], "pieces": []}
    for r in reports:
        for name, file, key, start, end, dtype in r["index"]:
            entry = tensors.setdefault(name, {"shape": None, "dtype": dtype, "pieces": []})
            entry["pieces"].append([file, key, start, end])
    if optim_state is not None:  # optimizer state has its parameter's shape
        for name, entry in tensors.items():
            if name.startswith("optim/"):
                param = name[len("optim/"):].rsplit("/", 1)[0]
                entry["shape"] = tensors[f"model/{param}"]["shape"]
    for entry in tensors.values():
        entry["pieces"].sort(key=lambda p: p[2])
    manifest = {
        "format": FORMAT, "version": 1, "saved_at": time.time(), "world_size": world,
        "strategy": _strategy(model_state), "precision": _precision(model_state),
        "step": values.get("step") if isinstance(values.get("step"), int) else None,
        "files": files, "tensors": tensors,
        "aliases": model_state.aliases if model_state is not None else {},
    }
    with open(os.path.join(partial, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(partial)
    parent = os.path.dirname(path)
    if os.path.exists(path):  # replace: the old one is moved aside, then removed
        old = f"{path}.old-{os.path.basename(partial).rsplit('-', 1)[1]}"
        os.rename(path, old)
        os.rename(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, path)
    fsync_dir(parent)
    if keep_last is not None:
        complete = _complete_checkpoints(parent)
        for _, old in complete[:-keep_last]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)


def _strategy(model_state) -> str | None:
    engine = model_state.engine if model_state is not None else None
    return engine.policy.name if engine is not None else None


def _precision(model_state) -> str | None:
    prepared = model_state.prepared if model_state is not None else None
    return prepared._precision.name if prepared is not None else None


def _complete_checkpoints(directory: str) -> list[tuple[float, str]]:
    """(saved_at, path) of every complete checkpoint directly in `directory`, oldest first."""
    found = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    for entry in entries:
        if ".partial-" in entry or ".old-" in entry:
            continue
        where = os.path.join(directory, entry)
        try:
            manifest = read_manifest(where)
        except CheckpointError:
            continue
        found.append((float(manifest.get("saved_at", 0.0)), where))
    return sorted(found)


def latest_checkpoint(directory) -> str | None:
    """The newest complete checkpoint in `directory` (a directory of checkpoints), or None."""
    complete = _complete_checkpoints(os.path.abspath(os.fspath(directory)))
    return complete[-1][1] if complete else None


# -- load -------------------------------------------------------------------------------------
def load(path, model=None, optimizer=None, strict: bool = True, **stateful) -> dict:
    """Restore what `px.save` saved, in place, at any world size and under any strategy and
    precision; a collective: every rank calls it. Returns the plain values saved (for
    example {"step": 1200}).

    Everything is checked before anything is changed: the manifest, every file's size and
    checksum (each rank checks its share), the model's names and shapes against the
    checkpoint's, and that every stateful object asked for was saved; a problem raises the same
    `CheckpointError` on every rank and leaves the model and optimizer untouched. With
    `strict=False` the tensors that match are loaded and the rest are named in a warning.
    """
    model_state = ModelState(model) if model is not None else None
    comm = model_state.comm if model_state is not None else default_comm()
    path = os.path.abspath(os.fspath(path))
    manifest, error = None, None
    try:
        manifest = read_manifest(path)
        files = sorted(manifest["files"])
        mine = [f for i, f in enumerate(files) if i % comm.world == comm.rank]
        problems = verify_files(path, manifest, mine)
        error = "; ".join(problems) or None
    except CheckpointError as exc:
        error = str(exc)
    _agree(comm, error, f"px.load({path!r})")

    small = torch.load(os.path.join(path, STATE_FILE), weights_only=False)
    reader = Reader(path, manifest)
    names: set[str] = set()
    problems = []
    if model_state is not None:
        names, problems = _match(model_state, manifest)
        if problems and strict:
            raise CheckpointError(f"px.load({path!r}): the checkpoint does not match the model: "
                                  + "; ".join(problems) + ". Load with strict=False to load "
                                  "what matches")
    optim_state = None
    if optimizer is not None:
        if model_state is None:
            raise ValueError("px.load(optimizer=...) needs model= too")
        if "optimizer" not in small:
            raise CheckpointError(f"px.load({path!r}): the checkpoint has no optimizer state "
                                  "(it was saved without optimizer=)")
        optim_state = OptimizerState(optimizer, model_state)
        optim_state.check(small["optimizer"])
    missing = [k for k in stateful if k not in small["stateful"]]
    if missing:
        raise CheckpointError(f"px.load({path!r}): nothing was saved for {', '.join(missing)}; "
                              f"the checkpoint has {sorted(small['stateful']) or 'none'} "
                              f"and the values {sorted(small['values']) or 'none'}")

    if model_state is not None:
        model_state.load(reader, names)
        scaler = model_state.prepared.loss_scaler if model_state.prepared is not None else None
        if scaler is not None and LOSS_SCALER in small["stateful"]:
            scaler.load_state_dict(small["stateful"][LOSS_SCALER])
    if optim_state is not None:
        optim_state.load(reader, small["optimizer"], names)
    for name, obj in stateful.items():
        obj.load_state_dict(small["stateful"][name])
    if comm.rank < len(small["rng"]):
        _set_rng_state(small["rng"][comm.rank])
    if problems:
        warnings.warn(f"px.load({path!r}, strict=False) left out: " + "; ".join(problems),
                      stacklevel=2)
    return dict(small["values"])


def _match(model_state: ModelState, manifest: dict) -> tuple[set[str], list[str]]:
    """The names to load, and what does not match (missing, unexpected, reshaped)."""
    saved = {k[len("model/"):]: v for k, v in manifest["tensors"].items()
             if k.startswith("model/")}
    saved_aliases = manifest.get("aliases", {})
    wanted = model_state.shapes()
    missing, reshaped, names = [], [], set()
    for name, (shape, _) in wanted.items():
        source = name if name in saved else saved_aliases.get(name)
        if source not in saved:
            missing.append(name)
        elif list(saved[source]["shape"]) != list(shape):
            reshaped.append(f"{name} {tuple(saved[source]['shape'])} -> {tuple(shape)}")
        else:
            names.add(name)
    unexpected = sorted(set(saved) - set(wanted) - set(model_state.aliases))
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        problems.append(f"not in the model: {', '.join(unexpected)}")
    if reshaped:
        problems.append(f"other shapes: {', '.join(reshaped)}")
    return names, problems


# -- export -----------------------------------------------------------------------------------
def export(path, model) -> str:
    """Write the full weights of `px.unwrap(model)` (fp32 masters for trained parameters, the
    original dtypes elsewhere) to one safetensors file under the module's own names, loadable
    with `model.load_state_dict(safetensors.torch.load_file(path))`. A collective when the
    masters are sharded (rank 0 gathers them and writes)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    state = ModelState(model)
    comm = state.comm
    owner = state.writer_of()
    local = [(r.name, r.start, r.end, r.values.detach().cpu().clone()) for r in state.ranges(owner)]
    gathered = comm.gather_object(local, dst=0, tag="export") if comm.world > 1 else [local]
    error = None
    if comm.rank == 0:
        try:
            full = {}
            shapes = state.shapes()
            for name, (shape, dtype) in shapes.items():
                full[name] = torch.empty(shape, dtype=dtype)
            for part in gathered:
                for name, start, end, values in part:
                    full[name[len("model/"):]].view(-1)[start:end] = values
            for alias, name in state.aliases.items():
                full[alias] = full[name].clone()
            _write_atomically(os.path.abspath(os.fspath(path)), full, save_file)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    _agree(comm, error, f"px.export({os.fspath(path)!r})")
    return os.fspath(path)


def export_checkpoint(checkpoint, out) -> str:
    """`phalanx export CKPT OUT`: the model's full weights from a checkpoint, offline (no
    process group), as one safetensors file."""
    from safetensors.torch import save_file  # noqa: PLC0415

    checkpoint = os.path.abspath(os.fspath(checkpoint))
    manifest = read_manifest(checkpoint)
    problems = verify_files(checkpoint, manifest, sorted(manifest["files"]))
    if problems:
        raise CheckpointError("; ".join(problems))
    reader = Reader(checkpoint, manifest)
    full = {k[len("model/"):]: reader.full(k) for k in manifest["tensors"] if k.startswith("model/")}
    for alias, name in manifest.get("aliases", {}).items():
        full[alias] = full[name].clone()
    _write_atomically(os.path.abspath(os.fspath(out)), full, save_file)
    return os.fspath(out)


def _write_atomically(path: str, tensors: dict, save_file) -> None:
    tmp = f"{path}.partial-{uuid.uuid4().hex[:12]}"
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
