"""A DCP checkpoint in and out: `px.load` of a torch.distributed.checkpoint directory (what FSDP2
scripts and torchtitan save), and `px.save(..., format="dcp")`.

Both go through DCP's own API, as an FSDP2 script calls it (tests/test_dcp_interop.py pins that
route both ways and this one, against FSDP2 and one process, in float64):

    dcp.save({"model": get_model_state_dict(model),                             # format="dcp"
              "optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
    dcp.load(templates, checkpoint_id=path); set_state_dict(model, optimizer, ...)   # px.load

[Note: loading a DCP checkpoint]
A DCP directory holds `.metadata` (every saved value's key, its path in the nested dict that
was saved, and for a tensor its global shape, dtype and where its chunks lie) and the ranks'
`*.distcp` files. Scripts nest the model's state dict under a key of their own ("model" in
FSDP2's examples) or none (torchtitan, whose optimizer state sits under "optimizer" in its
flattened form). So the model is found by its names: the saved tensors that share one parent
path and carry the most of the model's names; the optimizer by its `param_groups`, nested or
flattened (the flattened form is nested here: see `_nested`). Everything is checked against
the metadata before anything is read: the model's names and shapes, that the optimizer's state
is there, and the files and their sizes. The values are read into new tensors made from the
metadata (never into the model's own, nor through `get_optimizer_state_dict`, whose first call
on a new optimizer steps it once to make its state), so a read that fails (a damaged file)
leaves the model and optimizer as they were; only then does `set_state_dict` hand them over.
Every rank reads the whole model and optimizer state, as DCP's API does with a phalanx model,
whose state dicts are full.

What a DCP checkpoint lacks that a phalanx one has is not restored, and rank 0 says so: the RNG
states, a sampler's position, the loss scale, the values `px.save` keeps (`px.load` returns {}),
and the stateful objects passed to `px.load`, which are left as they are.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass, field

import torch

from ..world.runtime import default_comm
from .common import agree, mismatches
from .reader import MANIFEST, CheckpointError
from .state import ModelState

__all__ = ["DCP_METADATA", "FORMATS", "is_dcp_checkpoint", "load_dcp", "save_dcp"]

DCP_METADATA = ".metadata"  # what FileSystemWriter writes last, once every rank's file is written
FORMATS = ("phalanx", "dcp")


def is_dcp_checkpoint(path) -> bool:
    """A directory with DCP's `.metadata` and no phalanx manifest."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, DCP_METADATA)) and \
        not os.path.exists(os.path.join(path, MANIFEST))


# -- in -----------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """What to read, as the nested dict dcp.load fills, and where the model and optimizer are."""
    tree: dict = field(default_factory=dict)
    model_at: tuple | None = None
    names: list = field(default_factory=list)        # the model's names to load
    optim_at: tuple | None = None
    others: list = field(default_factory=list)       # top-level keys px.load does not read
    problems: list = field(default_factory=list)     # strict=False: what is left out


def load_dcp(path: str, model, optimizer, strict: bool, stateful: dict) -> dict:
    """`px.load` of a DCP checkpoint (see the Note); a collective. Returns {}."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    what = f"px.load({path!r})"
    state = ModelState(model) if model is not None else None
    comm = state.comm if state is not None else default_comm()
    if optimizer is not None and state is None:
        raise ValueError("px.load(optimizer=...) needs model= too")
    plan, error = None, None
    try:
        plan = _plan(path, state, optimizer, strict)
    except CheckpointError as exc:
        error = str(exc)
    agree(comm, error, what)
    try:  # into tensors of its own: a read that fails changes nothing (see the Note)
        with _alone_quietly():
            dcp_load(plan.tree, checkpoint_id=path, process_group=comm.group,
                     no_dist=comm.group is None)
    except _FAILURES as exc:  # agreed on by every rank below
        error = f"a file could not be read (damaged or altered?): {_why(exc)}"
    agree(comm, error, f"{what}: reading the DCP checkpoint")
    try:
        model_sd = {n: _get(plan.tree, plan.model_at + (n,)) for n in plan.names} \
            if state is not None else {}
        optim_sd = _nested(_get(plan.tree, plan.optim_at), optimizer, model) \
            if optimizer is not None else None
    except CheckpointError as exc:  # agreed on by every rank below
        error = str(exc)
    agree(comm, error, what)
    if state is not None:
        for alias, name in state.aliases.items():  # a tied weight saved under one name only
            if name in model_sd and alias not in model_sd:
                model_sd[alias] = model_sd[name]
        options = StateDictOptions(strict=strict)
        if optim_sd is not None:
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=options)
        else:
            set_model_state_dict(model, model_sd, options=options)
        if state.sharded:  # as px.load of a phalanx checkpoint: see load_checkpoint in api.py
            comm.barrier(tag="px.load: every shard loaded")
    if comm.rank == 0:
        warnings.warn(_lacks(path, stateful, plan), stacklevel=4)
        if plan.problems:
            warnings.warn(f"px.load({path!r}, strict=False) left out: " + "; ".join(plan.problems),
                          stacklevel=4)
    return {}


def _plan(path: str, state: ModelState | None, optimizer, strict: bool) -> _Plan:
    """Read and check the metadata (see the Note); raises CheckpointError."""
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

    try:
        meta = FileSystemReader(path).read_metadata()
        entries = meta.state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - whatever unpickling a damaged file raises
        raise CheckpointError(f"cannot read {os.path.join(path, DCP_METADATA)}, the metadata "
                              f"of a DCP checkpoint: {type(exc).__name__}: {exc}") from None
    paths = {key: tuple((meta.planner_data or {}).get(key, (key,))) for key in entries}
    plan = _Plan()
    optimizers = _optimizers(paths)
    if state is not None:  # the model first: another model's checkpoint says so first
        flattened_at = next(iter(optimizers)) if len(optimizers) == 1 else None
        plan.model_at, plan.names = _model_at(path, state, paths, entries, flattened_at, strict,
                                              plan.problems)
        shapes = state.shapes()
        for name in plan.names:
            shape, dtype = shapes.get(name) or shapes[state.aliases[name]]
            _put(plan.tree, plan.model_at + (name,), torch.empty(shape, dtype=dtype))
    if optimizer is not None:
        if not optimizers:
            raise CheckpointError(f"{path} holds no optimizer state (it was saved without it); "
                                  "load it without optimizer=")
        if len(optimizers) > 1:
            shown = ", ".join(sorted(".".join(map(str, f)) or "(the top level)"
                                     for f in optimizers))
            raise CheckpointError(f"{path} holds the state of several optimizers ({shown}): "
                                  "load it with DCP's API")
        plan.optim_at = next(iter(optimizers))
    if plan.optim_at is not None:
        n = len(plan.optim_at)
        for key, where in paths.items():
            if where[:n] == plan.optim_at and len(where) > n and _optimizer_key(where[n]):
                md = entries[key]
                _put(plan.tree, where, torch.empty(md.size, dtype=md.properties.dtype)
                     if isinstance(md, TensorStorageMetadata) else None)
    _check_files(path, meta)  # after the names: another model's metadata says so first
    read = {str(w[0]) for w in (plan.model_at, plan.optim_at) if w}
    top = {str(w[0]) for w in paths.values() if not (plan.model_at == () and len(w) == 1)}
    plan.others = sorted(top - read)
    return plan


def _check_files(path: str, meta) -> None:
    """Every file the metadata names is there and long enough (a missing or truncated shard)."""
    needed: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        where = os.path.join(path, name)
        if not os.path.isfile(where):
            problems.append(f"{name} is missing")
        elif os.path.getsize(where) < size:
            problems.append(f"{name} has {os.path.getsize(where)} bytes where the metadata "
                            f"places data up to byte {size} (truncated)")
    if problems:
        raise CheckpointError(f"{path} is a damaged DCP checkpoint: " + "; ".join(problems))


def _model_at(path, state, paths, entries, flattened_at, strict, problems) -> tuple[tuple, list]:
    """Where the model's tensors are (the parent path holding most of its names), and the names
    to load; raises on a mismatch unless `strict` is False (then `problems` names it)."""
    from torch.distributed.checkpoint import TensorStorageMetadata

    wanted = state.shapes()
    known = set(wanted) | set(state.aliases)
    children: dict[tuple, dict[str, object]] = {}
    for key, where in paths.items():
        if isinstance(entries[key], TensorStorageMetadata) and isinstance(where[-1], str):
            if where[:-1] == flattened_at and _optimizer_key(where[-1]):
                continue  # the optimizer's state in its flattened form
            children.setdefault(where[:-1], {})[where[-1]] = entries[key]
    score = {at: len(known & set(c)) for at, c in children.items()}
    best = max(score.values(), default=0)
    if best == 0:
        shown = sorted(entries)[:6]
        raise CheckpointError(f"{path} holds none of this model's tensors (it has "
                              f"{', '.join(shown)}{' ...' if len(entries) > 6 else ''}); it is "
                              "another model's checkpoint")
    tied = [".".join(map(str, at)) or "(the top level)" for at, s in score.items() if s == best]
    if len(tied) > 1:
        raise CheckpointError(f"{path} holds this model's names in several places ("
                              f"{', '.join(tied)}): load it with DCP's API, naming the one")
    at = next(at for at, s in score.items() if s == best)
    saved = children[at]
    missing = [n for n in wanted if n not in saved]
    reshaped = [f"{n} {tuple(saved[n].size)} -> {tuple(wanted[n][0])}" for n in wanted
                if n in saved and list(saved[n].size) != list(wanted[n][0])]
    unexpected = sorted(set(saved) - known)
    found = mismatches(missing, unexpected, reshaped)
    if found and strict:
        raise CheckpointError(f"{path}: the DCP checkpoint does not match the model: "
                              + "; ".join(found) + ". Load with strict=False to load what "
                              "matches")
    problems += found
    names = [n for n in wanted if n in saved and list(saved[n].size) == list(wanted[n][0])]
    names += [a for a, n in state.aliases.items() if a in saved and n in names]
    return at, names


def _optimizer_key(key) -> bool:
    """A key of an optimizer's state dict, nested (`state`, `param_groups`) or flattened
    (`state.<name>.<key>`, `param_groups.<name>.<hyperparameter>`)."""
    return isinstance(key, str) and (key in ("state", "param_groups")
                                     or key.startswith(("state.", "param_groups.")))


def _optimizers(paths: dict) -> set[tuple]:
    """The parent paths of the optimizer state dicts saved (found by their param groups)."""
    found = set()
    for where in paths.values():
        for i, key in enumerate(where):
            if key == "param_groups" and i + 1 < len(where) and isinstance(where[i + 1], int):
                found.add(where[:i])
            elif isinstance(key, str) and key.startswith("param_groups."):
                found.add(where[:i])
    return found


def _nested(optim_sd: dict, optimizer, model) -> dict:
    """The optimizer's state dict in torch's nested form, keyed by parameter names, checked:
    its param groups hold this optimizer's parameters, group by group.

    The flattened form (torchtitan's: `state.<name>.<key>`, `param_groups.<name>.<key>`) is
    nested here, not by `set_state_dict`, which unflattens by `optimizer.state[param]`: a
    prepared optimizer keys its state by its master pieces (engine/optim.py), so torch found
    no state to fill and loaded none. A hyperparameter it lacks keeps this optimizer's value
    (`initial_lr`, which a scheduler adds)."""
    names = {id(p): n for n, p in model.named_parameters()}
    mine = [[names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups]
    if not isinstance(optim_sd.get("param_groups"), list):
        nested = {"state": {}, "param_groups": []}
        for key, value in optim_sd.items():
            if key.startswith("state."):
                name, what = key[len("state."):].rsplit(".", 1)
                nested["state"].setdefault(name, {})[what] = value
        saved = {}
        for key, value in optim_sd.items():
            if key.startswith("param_groups."):
                name, what = key[len("param_groups."):].rsplit(".", 1)
                saved.setdefault(name, {})[what] = value
        missing = [n for group in mine for n in group if n not in saved]
        if missing:
            raise CheckpointError(f"the checkpoint's optimizer has no param group for "
                                  f"{', '.join(missing)}")
        for group, params in zip(optimizer.param_groups, mine):
            kept = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            nested["param_groups"].append({**kept, **saved[params[0]], "params": params})
        optim_sd = nested
    saved = [sorted(g.get("params", [])) if isinstance(g, dict) else None
             for g in optim_sd["param_groups"]]
    if saved != [sorted(group) for group in mine]:
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} param group(s) of "
                              f"{saved}, this optimizer {len(mine)} of {mine}")
    return optim_sd


def _lacks(path: str, stateful: dict, plan: _Plan) -> str:
    """Rank 0's warning: what this load did not restore (see the Note)."""
    text = (f"px.load({path!r}) loaded a DCP checkpoint (torch.distributed.checkpoint), which "
            "holds the model and optimizer but not what px.save keeps beside them: this "
            "process's RNG states are left as they were, no sampler position, loss scale or "
            "saved values are restored, and px.load returns {}")
    if stateful:
        text += f"; {', '.join(f'{k}=' for k in stateful)} left as they are"
    if plan.others:
        text += (f". The checkpoint also holds {', '.join(plan.others)}, which px.load does not "
                 "read (dcp.load reads them into your own state dicts)")
    return text


def _failures() -> tuple:
    from torch.distributed.checkpoint import CheckpointException  # a BaseException

    return (Exception, CheckpointException)


_FAILURES = _failures()


def _why(exc: BaseException) -> str:
    """An error of dcp.load or dcp.save in a line: DCP's CheckpointException holds every rank's
    exception with its traceback; each distinct one is named once, with its ranks."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return f"{type(exc).__name__}: {exc}"
    seen: dict[str, list[int]] = {}
    for rank, (error, _) in sorted(failures.items()):
        first = (str(error).splitlines() or [""])[0].split(". ")[0][:200]  # its first sentence
        line = f"{type(error).__name__}: {first}"
        seen.setdefault(line, []).append(rank)
    return "; ".join(f"{line} (DCP's rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})"
                     for line, r in seen.items())


@contextlib.contextmanager
def _alone_quietly():
    """In a world of one, without DCP's warning that it assumes one process (it is one)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _put(tree, where: tuple, value) -> None:
    """Set `value` at the path `where` of nested dicts and lists, making them as needed."""
    node = tree
    for key, after in zip(where[:-1], where[1:]):
        made = [] if isinstance(after, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = made
            node = node[key]
        else:
            node = node.setdefault(key, made)
    if isinstance(node, list):
        node.extend([None] * (where[-1] + 1 - len(node)))
    node[where[-1]] = value


def _get(tree, where: tuple):
    for key in where:
        tree = tree[key]
    return tree


# -- out ----------------------------------------------------------------------------------------
def save_dcp(path, model, optimizer, keep_last, background, values) -> str:
    """`px.save(path, model, optimizer, format="dcp")`: `dcp.save` of the model's and the
    optimizer's state dicts, as {"model": ..., "optimizer": ...}, written under a temporary name
    and renamed when complete (a collective). Only the model and optimizer: a DCP checkpoint
    holds no RNG states, sampler position or values (see the Note), so those arguments are
    refused rather than dropped."""
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    refused = [f"{k}=" for k in values] + (["keep_last="] if keep_last is not None else []) \
        + (["background=True"] if background else [])
    if refused:
        raise ValueError(f"px.save(format='dcp') saves the model and optimizer only, not "
                         f"{', '.join(refused)}: a DCP checkpoint has no place for them. Save "
                         "a phalanx checkpoint (the default format) to keep them")
    if model is None:
        raise ValueError("px.save(format='dcp') needs model=")
    state = ModelState(model)
    comm = state.comm
    path = os.path.abspath(os.fspath(path))
    problem = _why_not_target(path) if comm.rank == 0 else None
    seen = comm.all_gather_object((uuid.uuid4().hex[:12], path, problem), tag="save:dcp")
    if any(s[1] != path for s in seen):
        raise ValueError(f"px.save: every rank must give the same path; the ranks gave "
                         f"{', '.join(repr(s[1]) for s in seen)}")
    if seen[0][2] is not None:
        raise CheckpointError(f"px.save({path!r}, format='dcp') refused: {seen[0][2]}")
    partial, error = f"{path}.partial-{seen[0][0]}", None
    try:
        saved = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            saved["optimizer"] = get_optimizer_state_dict(model, optimizer)
        with _alone_quietly():
            dcp_save(saved, checkpoint_id=partial, process_group=comm.group,
                     no_dist=comm.group is None)
    except _FAILURES as exc:  # agreed on by every rank below
        error = _why(exc)
    try:
        agree(comm, error, f"px.save({path!r}, format='dcp')")
        if comm.rank == 0:  # every rank's file and the metadata are written: dcp.save's end
            try:
                if os.path.isdir(path):  # an empty directory (_why_not_target)
                    os.rmdir(path)
                os.rename(partial, path)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        agree(comm, error, f"px.save({path!r}, format='dcp'): the rename into place")
    finally:
        if comm.rank == 0 and os.path.isdir(partial):
            shutil.rmtree(partial, ignore_errors=True)
    return path


def _why_not_target(path: str) -> str | None:
    """None where a DCP save may go: nothing there, or an empty directory. It replaces nothing,
    not even an earlier checkpoint (whose files it cannot tell from the user's)."""
    if not os.path.lexists(path):
        return None
    if os.path.isdir(path) and not os.path.islink(path):
        entries = sorted(os.listdir(path))
        if not entries:
            return None
        shown = ", ".join(entries[:5]) + (" ..." if len(entries) > 5 else "")
        return (f"{path} is a directory holding {shown}; a DCP save writes only where nothing "
                "is: give it a new path")
    return f"{path} is a file; a DCP save writes a directory: give it a new path"
