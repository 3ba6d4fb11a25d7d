"""`px.save`: a snapshot of what each rank holds, then files, a manifest and a rename.

[Note: saving in the background]
A save has two halves. The snapshot reads, on every rank, what it will write: its ranges of
the masters and optimizer state, the stateful objects' `state_dict()`, the RNG states. The
write puts the ranges in the rank's file, gathers every rank's index to rank 0, which writes
the small state and the manifest and renames the directory into place. With
`background=True` the snapshot copies the ranges to CPU memory (so the next optimizer step
may change the originals) and the write runs in a thread; training goes on as soon as the
copy is made. The thread's collectives (gathering the indexes, agreeing on errors) go over a
process group of their own, made once by every rank at the first background save, so they
never interleave with the training's collectives on the job's group. The copies are kept for
the next background save (`state.staged`), whose snapshot copies into them once the previous
write is done (every save waits for it first): the first copy's time is mostly the kernel's
zeroing of new pages (ddp's 288 MB share of a 50M-parameter model with AdamW: 0.19 s first,
0.05 s into the kept copy, 0.17 s into memory freed and given back: benchmarks/checkpoint.py),
and the memory is the rank's share of the checkpoint, held from the first background save on
(px.shutdown() lets it go). The next `px.save`,
`px.load` or `px.shutdown()` (or `phalanx.checkpoint.wait_for_saves()`) waits for a save still
running and raises its error, if it had one, on every rank.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field

import torch

from ..comm import continuation
from ..comm.collectives import Comm
from ..comm.gate import step_lost
from ..model.prepare import prepared_or_none
from ..spec.arguments import check_checkpoint_call
from ..world import runtime
from ..world.environment import why_not_writable_dir
from ..world.process import state
from ..world.runtime import default_comm
from .common import (
    LOSS_SCALER,
    OPTIM,
    STATE_FILE,
    agree,
    is_stateful,
    model_key,
    optim_parts,
    rng_state,
)
from .dcp import FORMATS, save_dcp
from .files import file_digest, fsync_dir, write_tensors
from .ownership import agree_on_job, job_ids, manifest_fields
from .parts import keep_small, part_ranges
from .reader import FORMAT, MANIFEST, CheckpointError
from .removal import remove_older, why_not_replaceable
from .state import ModelState, OptimizerState

__all__ = ["save", "wait_for_saves"]


@dataclass
class _Snapshot:
    """Everything the write half needs, read at the time of the call."""
    path: str
    partial: str
    keep_last: int | None
    jobs: list = field(default_factory=list)      # this job's id, then those it adopted
    tensors: dict = field(default_factory=dict)   # key in the rank's file -> 1-D tensor
    index: list = field(default_factory=list)     # (name, file, key, start, end, dtype)
    whole: dict = field(default_factory=dict)     # optimizer state that is not per element
    keys: dict = field(default_factory=dict)      # parameter name -> per-element state names
    like: dict = field(default_factory=dict)      # a part's tensor -> the model tensor it is
    rng: dict = field(default_factory=dict)
    small: dict | None = None                     # rank 0: stateful objects and values
    meta: dict | None = None                      # rank 0: what the manifest says of the model


def save(path, model=None, optimizer=None, keep_last: int | None = None,
         background: bool = False, format: str = "phalanx", **values) -> str:
    """Save a checkpoint to the directory `path`; a collective: every rank calls it.

    Each rank writes what it holds (its shards, and its share of what every rank holds whole)
    to its own file, in parallel; rank 0 adds the small state and, last, the manifest. The
    checkpoint is written under a temporary name and renamed when complete, so a crash at any
    moment leaves the previous checkpoint as it was. A keyword value is saved through its
    `state_dict()` when it has `state_dict`/`load_state_dict` (a sampler, a scheduler), else
    as a plain picklable value (rank 0's). With `keep_last=k`, only the k newest complete
    checkpoints of this job in `path`'s parent directory are kept, and what its abandoned saves
    left there is removed: this job's are those it wrote and, once it has loaded a checkpoint
    (a restarted job resuming), those of the job that wrote that one; another job's
    checkpoints and saves in progress there are never touched. With `background=True` the call
    returns once the state is copied to CPU memory (into the last background save's copy, kept
    for it), and a thread writes the files while training goes on (its collectives on a
    process group of their own); the next `px.save`,
    `px.load` or `px.shutdown()` waits for it and raises its error, if it had one, on every
    rank. Returns `path`.

    With `format="dcp"` it writes a torch.distributed.checkpoint directory instead, as FSDP2
    scripts do (`dcp.save` of the model's and the optimizer's state dicts, under the keys
    "model" and "optimizer"), which FSDP2 loads with DCP's API and `px.load` loads: the model
    and optimizer only, no RNG states, sampler position or values (they are refused), into a
    new path (absent or an empty directory).
    """
    check_checkpoint_call("px.save", path, model, optimizer)
    if format not in FORMATS:
        raise ValueError(f"px.save(format={format!r}): the formats are {', '.join(FORMATS)}")
    prepared = prepared_or_none(model) if model is not None else None
    if prepared is not None:  # a step that raised on this rank is voted down first (engine/vote.py)
        prepared._engine.vote.catch_up()
    # See [Note: saving in the background] above.
    wait_for_saves()
    if format == "dcp":  # See [Note: loading a DCP checkpoint] in dcp.py
        return save_dcp(path, model, optimizer, keep_last, background, values)
    if step_lost():  # phalanx run --on-failure continue: see [Note: a save in a lost step]
        _skipped(path)
        return path
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise ValueError(f"px.save(keep_last={keep_last!r}): keep_last is the number of "
                         "checkpoints to keep, 1 or more (or None to keep all)")
    if optimizer is not None and model is None:
        raise ValueError("px.save(optimizer=...) needs model= too: the optimizer's state is "
                         "stored by the names of the model's parameters")
    model_state = ModelState(model) if model is not None else None
    comm = model_state.comm if model_state is not None else default_comm()
    optim_state = OptimizerState(optimizer, model_state) if optimizer is not None else None
    path = os.path.abspath(os.fspath(path))
    # See [Note: a save removes only checkpoints] in removal.py: rank 0, which completes the
    # checkpoint, looks at what stands at `path`, and every rank learns its answer.
    problem = why_not_replaceable(path) if comm.rank == 0 else None
    seen = comm.all_gather_object((uuid.uuid4().hex[:12], path, problem, job_ids()),
                                  tag="save:token")
    if step_lost():  # lost meanwhile (the tokens are then each rank's own)
        _skipped(path)
        return path
    jobs = agree_on_job([s[3] for s in seen])  # See [Note: a job removes only what it wrote]
    token = f"{jobs[0]}-{seen[0][0]}"
    if any(s[1] != path for s in seen):
        raise ValueError(f"px.save: every rank must give the same path; the ranks gave "
                         f"{', '.join(repr(s[1]) for s in seen)} (build it from values all "
                         "ranks share, such as the step, not from a per-process temporary "
                         "directory)")
    if seen[0][2] is not None:
        raise CheckpointError(f"px.save({path!r}) refused: {seen[0][2]}")
    stateful = {k: v for k, v in values.items() if is_stateful(v)}  # what a reload restores
    # a replacement waiting to join is admitted once this save is complete (continuing/joining.py)
    joining = continuation.now().joiners_asking(comm)
    background = background and not joining
    snapshot, error = None, None
    try:
        snapshot = _take_snapshot(path, f"{path}.partial-{token}", keep_last, model_state,
                                  optim_state, values, comm, copy_out=background)
        snapshot.jobs = jobs
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = f"{type(exc).__name__}: {exc}"
    agree(comm, error, f"px.save({path!r}): reading the state to save", saving=True)
    if step_lost():  # lost meanwhile: see [Note: a save in a lost step]
        _skipped(path)
        return path
    if not background:
        if not _write(snapshot, comm):
            _skipped(path)
            return path
        continuation.now().saved(path, model, optimizer, stateful)  # --on-failure continue
        if joining:
            continuation.now().admit_at_save(comm, joining, path, model, optimizer, stateful)
        return path
    # gloo: the writes gather small Python objects; see groups.py
    writer = comm.apart("checkpoint:saves", backend="gloo")
    job = _Job(path)
    if continuation.continuing():  # once written, where a sharded engine reloads from
        continuing = continuation.now()
        job.on_written = lambda: continuing.saved(path, model, optimizer, stateful)
    thread = threading.Thread(target=job.run, args=(snapshot, writer), name="phalanx-save")
    job.thread = thread
    state.saves.append(job)
    thread.start()
    return path


# -- the snapshot -------------------------------------------------------------------------------
@torch.no_grad()
def _take_snapshot(path, partial, keep_last, model_state, optim_state, values, comm,
                   copy_out: bool) -> _Snapshot:
    snap = _Snapshot(path, partial, keep_last)
    own_file = f"rank{comm.rank:05d}.safetensors"
    ranges, smalls = [], []
    if model_state is not None:
        owner = model_state.writer_of()
        ranges += model_state.ranges(owner)
        if optim_state is not None:
            optim_ranges, snap.whole = optim_state.ranges(owner)
            ranges += optim_ranges
            for r in optim_ranges:
                param, key = optim_parts(r.name)
                snap.keys.setdefault(param, set()).add(key)
        # the features beside the strategy: see [Note: a part in a checkpoint] in
        # engine/part.py (a collective where a part's state is one)
        parts, smalls, snap.like = part_ranges(model_state, optim_state, owner)
        ranges += parts
    on_gpu, kept = False, state.staged if copy_out else {}
    if copy_out:
        state.staged = {}
    for r in ranges:
        key = f"{r.name}@{r.start}"
        values_ = r.values.detach()
        if copy_out:  # pinned and without blocking from a GPU: one wait for them all, below
            on_gpu = on_gpu or values_.device.type == "cuda"
            staged = kept.get(key)
            if staged is None or staged.shape != values_.shape \
                    or staged.dtype != values_.dtype:
                staged = torch.empty(values_.shape, dtype=values_.dtype,
                                     pin_memory=values_.device.type == "cuda")
            values_ = state.staged[key] = staged.copy_(values_, non_blocking=True)
        snap.tensors[key] = values_
        snap.index.append((r.name, own_file, key, r.start, r.end, str(r.values.dtype)[6:]))
    if on_gpu:
        torch.cuda.current_stream().synchronize()
    snap.keys = {k: sorted(v) for k, v in snap.keys.items()}
    snap.rng = rng_state()
    if comm.rank == 0:
        small = {"values": {}, "stateful": {}}
        for name, value in values.items():
            if is_stateful(value):
                small["stateful"][name] = copy.deepcopy(value.state_dict())
            else:
                small["values"][name] = copy.deepcopy(value)
        if model_state is not None and model_state.prepared is not None:
            scaler = model_state.prepared.loss_scaler
            if scaler is not None:
                small["stateful"][LOSS_SCALER] = copy.deepcopy(scaler.state_dict())
        for at, value in smalls:  # the parts' small values
            keep_small(small, at, value)
        snap.small = small
        step = values.get("step")
        snap.meta = {
            "world_size": comm.world,
            "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
            "strategy": model_state.engine.policy.name
            if model_state is not None and model_state.engine is not None else None,
            "precision": model_state.prepared._precision.name
            if model_state is not None and model_state.prepared is not None else None,
            "shapes": {n: (shape, str(dtype)[6:]) for n, (shape, dtype) in
                       model_state.shapes().items()} if model_state is not None else {},
            "aliases": dict(model_state.aliases) if model_state is not None else {},
            "optimizer": {"hyperparameters": copy.deepcopy(optim_state.hyperparameters()),
                          "group_names": optim_state.group_names}
            if optim_state is not None else None,
        }
    return snap


# -- the write ----------------------------------------------------------------------------------
def _write(snap: _Snapshot, comm: Comm) -> bool:
    """Every rank writes its file; rank 0 completes the checkpoint; every rank raises alike.
    False: nothing was written, a rank being lost meanwhile ([Note: a save in a lost step])."""
    own_file = f"rank{comm.rank:05d}.safetensors"
    report, error, made = None, None, False
    try:
        os.makedirs(snap.partial, exist_ok=True)
        made = True
        info = write_tensors(os.path.join(snap.partial, own_file), snap.tensors)
        report = {"file": own_file, "info": info, "index": snap.index, "whole": snap.whole,
                  "keys": snap.keys, "like": snap.like, "rng": snap.rng}
    except Exception as exc:  # noqa: BLE001 - agreed on by every rank below
        error = _failure(exc, snap, made)
    snap.tensors = {}  # the copies are written: let them go
    try:
        agree(comm, error, f"px.save({snap.path!r}): writing the ranks' files", saving=True)
        reports = comm.gather_object(report, dst=0, tag="save:reports")
    except CheckpointError:
        if comm.rank == 0:
            shutil.rmtree(snap.partial, ignore_errors=True)
        raise
    except Exception:  # a peer went away (the job is ending): no half-written save is left
        shutil.rmtree(snap.partial, ignore_errors=True)
        raise
    if step_lost():  # a rank was lost during the save: see [Note: a save in a lost step]
        # every rank, after its own write: one still writing when another removed the
        # directory made it again, and the last to remove it comes after every write
        shutil.rmtree(snap.partial, ignore_errors=True)
        return False
    error = None
    if comm.rank == 0:
        try:
            _complete(snap, reports)
        except Exception as exc:  # noqa: BLE001 - agreed on by every rank below
            error = _failure(exc, snap)
            shutil.rmtree(snap.partial, ignore_errors=True)
    agree(comm, error, f"px.save({snap.path!r}): completing the checkpoint", saving=True)
    # lost while rank 0 completed it: whether it did is unknown here, so the save counts as
    # not written (a sharded engine then reloads the one before it, which is complete)
    return not step_lost()


def _failure(exc: Exception, snap: _Snapshot, made: bool = True) -> str:
    """The error of a rank's part of a save, with its cause and fix where the error alone
    leaves the user guessing: the directory the save writes into could not be made (`made`
    False: under a file, read-only, not this user's), was removed by another process while
    the ranks wrote it (a bare FileNotFoundError), or the disk is full."""
    error = f"{type(exc).__name__}: {exc}"
    code = exc.errno if isinstance(exc, OSError) else None
    parent = os.path.dirname(snap.path)
    if made and (isinstance(exc, FileNotFoundError) or not os.path.isdir(snap.partial)):
        return error + (f" ({snap.partial}, where this save writes before the rename, was "
                        "removed or emptied while the ranks wrote it: by another process, not "
                        "by this job; nothing of this save was kept and the previous checkpoint "
                        "stands)")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return error + (f" (no space left in {parent}: free some, or save elsewhere; nothing "
                        "of this save was kept and the previous checkpoint stands)")
    if not made or code in _NOT_WRITABLE:
        why = why_not_writable_dir(parent) or \
            f"cannot write in {parent}: {getattr(exc, 'strerror', None) or exc}"
        return error + (f" ({why}; give it a path in a directory this user can write to; "
                        "nothing of this save was kept)")
    return error


# what an OSError says of a directory a save cannot write in
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)


def _complete(snap: _Snapshot, reports: list) -> None:
    """Rank 0: the small state, the manifest (last), then the rename into place."""
    meta = snap.meta
    files = {r["file"]: r["info"] for r in reports}
    for name, info in files.items():  # every rank's file still there, as written
        where = os.path.join(snap.partial, name)
        if not os.path.isfile(where) or os.path.getsize(where) != info["bytes"]:
            raise FileNotFoundError(f"{name}, which its rank wrote, is gone or has changed")
    small = dict(snap.small, rng=[r["rng"] for r in reports])
    if meta["optimizer"] is not None:
        whole, keys = {}, {}
        for r in reports:
            whole.update(r["whole"])
            for name, ks in r["keys"].items():
                keys.setdefault(name, set()).update(ks)
        small["optimizer"] = dict(meta["optimizer"], whole=whole,
                                  keys={k: sorted(v) for k, v in keys.items()})
    state_path = os.path.join(snap.partial, STATE_FILE)
    with open(state_path, "wb") as f:
        torch.save(small, f)
        f.flush()
        os.fsync(f.fileno())
    files[STATE_FILE] = {"bytes": os.path.getsize(state_path), "crc32": file_digest(state_path)}

    tensors = {model_key(name): {"shape": shape, "dtype": dtype, "pieces": []}
               for name, (shape, dtype) in meta["shapes"].items()}
    like = {}
    for r in reports:
        like.update(r["like"])
        for name, file, key, start, end, dtype in r["index"]:
            entry = tensors.setdefault(name, {"shape": None, "dtype": dtype, "pieces": []})
            entry["pieces"].append([file, key, start, end])
    for name, entry in tensors.items():
        if name.startswith(OPTIM):  # optimizer state has its parameter's shape
            entry["shape"] = tensors[model_key(optim_parts(name)[0])]["shape"]
        elif name in like:  # a part's tensor shaped as a model tensor
            entry["shape"] = tensors[model_key(like[name])]["shape"]
        elif entry["shape"] is None:  # a part's flat tensor
            entry["shape"] = [max(p[3] for p in entry["pieces"])]
        entry["pieces"].sort(key=lambda p: p[2])
    manifest = {
        "format": FORMAT, "version": 1, "saved_at": time.time(),
        "world_size": meta["world_size"], "strategy": meta["strategy"],
        "precision": meta["precision"], "step": meta["step"],
        "files": files, "tensors": tensors, "aliases": meta["aliases"],
        **manifest_fields(snap.jobs),
    }
    with open(os.path.join(snap.partial, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(snap.partial)
    path, parent = snap.path, os.path.dirname(snap.path)
    problem = why_not_replaceable(path)  # again: it may have changed while the ranks wrote
    if problem is not None:
        raise CheckpointError(f"refused: {problem}")
    if os.path.lexists(path):  # replace: the old one is moved aside, then removed
        old = f"{path}.old-{snap.partial.rsplit('.partial-', 1)[1]}"  # job and token
        os.rename(path, old)
        os.rename(snap.partial, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(snap.partial, path)
    fsync_dir(parent)
    if snap.keep_last is not None:  # See [Note: a job removes only what it wrote]
        remove_older(parent, path, snap.keep_last, snap.jobs)


# -- a save in a lost step ------------------------------------------------------------------------
def _skipped(path: str) -> None:
    """[Note: a save in a lost step]
    Under `phalanx run --on-failure continue`, a save called while the step in flight is lost
    (a rank died: comm/gate.py), or during which a rank is lost, writes nothing: the state
    it would hold is that of a step the survivors throw away, and the others may never take
    part. Whatever it had written under its temporary name is removed (rank 0 completes a
    checkpoint only after every rank's part arrived), the previous checkpoint stays as it was,
    and this warning says so; the next `px.save` writes the live state. A rank lost while rank
    0 completes the checkpoint leaves the others unsure whether it did: they count the save as
    not written (a sharded engine reloads the one before), though it may stand complete."""
    warnings.warn(f"px.save({path!r}) wrote nothing: a rank was lost during this step (phalanx "
                  "run --on-failure continue); the previous checkpoint stands, and the next "
                  "px.save writes the state the survivors go on from", stacklevel=3)


# -- background saves ----------------------------------------------------------------------------
class _Job:
    def __init__(self, path: str):
        self.path = path
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.seconds, self.written = None, True  # the write's time; False: a rank was lost
        self.on_written = None  # called once the checkpoint is complete

    def run(self, snap: _Snapshot, comm: Comm) -> None:
        start = time.perf_counter()
        try:
            self.written = _write(snap, comm)
            if self.written and self.on_written is not None:
                self.on_written()
        except BaseException as exc:  # noqa: BLE001 - kept for the caller's next wait
            self.error = exc
        self.seconds = time.perf_counter() - start


def wait_for_saves() -> None:
    """Wait for a background save still running and raise its error (save, load, shutdown)."""
    while state.saves:
        job = state.saves.pop(0)
        job.thread.join()
        if job.error is not None:
            raise job.error
        if not job.written:
            _skipped(job.path)


runtime.before_shutdown(wait_for_saves)
