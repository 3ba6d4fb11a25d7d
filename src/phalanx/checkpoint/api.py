"""`px.load`, `px.latest_checkpoint` and `px.export` (saving is in saving.py)."""

from __future__ import annotations

import os
import warnings

import torch

from ..comm import continuation
from ..data.sampler import DistributedSampler
from ..spec.arguments import check_checkpoint_call, check_model, check_path
from ..world import runtime
from ..world.runtime import default_comm
from .common import LOSS_SCALER, MODEL, STATE_FILE, agree, mismatches, set_rng_state, under
from .dcp import is_dcp_checkpoint, load_dcp
from .export import (
    Entry,
    check_options,
    output_dtype,
    plan,
    why_not_directory,
    write_plan,
)
from .lora import (
    ADAPTER_FILE,
    adapter_config,
    adapter_entries,
    check_config,
    configured,
    merged,
    merged_entries,
    peft_config,
    write_config,
)
from .ownership import adopt, checkpoints_of, job_ids
from .parts import load_parts
from .reader import CheckpointError, Reader, newest_intact, read_manifest, verify_files
from .removal import why_not_export_target
from .saving import wait_for_saves
from .state import ModelState, OptimizerState

__all__ = ["load", "load_checkpoint", "latest_checkpoint", "fallbacks", "export",
           "export_checkpoint"]


def latest_checkpoint(directory) -> str | None:
    """The newest complete checkpoint in `directory` (a directory of checkpoints) whose files
    verify, or None when it holds no complete checkpoint.

    Each candidate, newest first, is checked as `px.load` checks it: every file the manifest
    lists is there with its size and CRC-32 (a read of the whole checkpoint, on every rank
    that calls it; CRC-32 ran at 3.3 GB/s over a 576 MB file). A damaged one (a truncated,
    corrupted or missing file, an unreadable manifest) is skipped for the one before it, and
    rank 0 warns, naming each checkpoint skipped and why, on its stderr (which `phalanx run`
    shows and keeps with the workers' logs). When checkpoints are there but none verifies it
    raises `CheckpointError` naming them, rather than let the job start again from nothing.
    `px.load` of a damaged checkpoint named explicitly stays an error.

    In a replacement under `phalanx run --on-failure continue`, it waits to be admitted at
    the others' next `px.save` and returns what that save wrote, so the script's own resume
    lines (`px.load(px.latest_checkpoint(...), ...)`) put it where the others stand; a script
    that never saves never admits a replacement."""
    check_path("px.latest_checkpoint(directory)", directory, "a directory of checkpoints",
               "px.latest_checkpoint('checkpoints')")
    if continuation.now().joining():  # a replacement: [Note: joining at a save] (continuing/)
        return continuation.now().wait_for_admission()
    directory = os.path.abspath(os.fspath(directory))
    chosen, skipped = newest_intact(directory)
    damage = "; ".join(f"{path}: {why}" for path, why in skipped)
    if chosen is None and skipped:
        raise CheckpointError(
            f"px.latest_checkpoint({directory!r}): no checkpoint there verifies ({damage}); "
            "restore one, or move them aside to start from the beginning")
    if skipped and runtime.rank() == 0:
        warnings.warn(f"px.latest_checkpoint({directory!r}) skipped {len(skipped)} damaged "
                      f"checkpoint{'s' if len(skipped) > 1 else ''} and returns {chosen}, the "
                      f"newest that verifies: {damage}", stacklevel=2)
    return chosen


def fallbacks(newest) -> list[str]:
    """`newest`, then the older complete checkpoints this job wrote beside it, newest first:
    where a reload after a loss under `--on-failure continue` goes back to, in turn, while the
    one it tries does not verify (a job's own: see ownership.py; never another job's)."""
    newest = os.path.abspath(os.fspath(newest))
    ours = checkpoints_of(os.path.dirname(newest), job_ids())  # oldest first
    older = ours[:ours.index(newest)] if newest in ours else ours
    return [newest, *reversed(older)]


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

    `path` may also be a torch.distributed.checkpoint (DCP) directory, as FSDP2 scripts and
    torchtitan save (or `px.save(..., format="dcp")`): its model and optimizer state are loaded
    through DCP's API, checked first as above. Such a checkpoint holds no RNG states, sampler
    position or values: rank 0 warns that they are not restored, the stateful objects passed
    are left as they are, and it returns {}.

    Under `phalanx run --on-failure continue`, in a replacement for a lost rank, it loads the
    checkpoint the others save next, with them, whatever `path` says: their live state, so it
    returns exactly the values they passed to that save and its sampler stands where theirs
    stand.
    """
    check_checkpoint_call("px.load", path, model, optimizer)
    # How the replacement is admitted: [Note: joining at a save] in continuing/joining.py.
    if continuation.now().joining():
        return continuation.now().join_at_load(lambda at: load_checkpoint(
            at, model, optimizer, strict, stateful, restore_rng=False))
    return load_checkpoint(path, model, optimizer, strict, stateful)


def load_checkpoint(path, model, optimizer, strict: bool, stateful: dict,
                    restore_rng: bool = True) -> dict:
    """`px.load`'s work (see it); `restore_rng=False` leaves this rank's generators alone."""
    wait_for_saves()  # a background save of this very checkpoint may still be running
    if is_dcp_checkpoint(path):  # FSDP2's or torchtitan's: see [Note: loading a DCP checkpoint]
        return load_dcp(os.path.abspath(os.fspath(path)), model, optimizer, strict, stateful)
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
    agree(comm, error, f"px.load({path!r})")

    # map_location: a stateful value saved from a GPU loads on the CPU, not on the saving
    # rank's GPU (which this process may not have)
    small = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=False)
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

    reader = Reader(path, manifest)
    try:
        if model_state is not None:
            model_state.load(reader, names)
            scaler = model_state.prepared.loss_scaler if model_state.prepared is not None \
                else None
            if scaler is not None and LOSS_SCALER in small["stateful"]:
                scaler.load_state_dict(small["stateful"][LOSS_SCALER])
        if optim_state is not None:
            optim_state.load(reader, small["optimizer"], names)
        if model_state is not None:  # the features beside the strategy: parts.py
            load_parts(model_state, optim_state, reader, manifest, small, names)
    finally:
        reader.close()
    if model_state is not None and model_state.sharded:
        # A rank alone may read its peers' masters and optimizer state next (state_dict(),
        # engine/remote.py): not before every peer has loaded its own. (Without this, a 2-rank
        # zero3 load followed at once by state_dict() returned a parameter unlike the saved
        # one in 1 of 8 runs of tests/test_hybrid.py's checkpoint test.)
        comm.barrier(tag="px.load: every shard loaded")
    for name, obj in stateful.items():
        obj.load_state_dict(small["stateful"][name])
    adopt(manifest)  # its writer's saves are this job's now: see ownership.py
    if restore_rng and comm.rank < len(small["rng"]):
        rng = small["rng"][comm.rank]
        set_rng_state(rng)
        for obj in stateful.values():  # See [Note: a pass continued] in data/sampler.py
            if isinstance(obj, DistributedSampler):
                obj._on_continued_pass(lambda: set_rng_state(rng))
    if problems:
        warnings.warn(f"px.load({path!r}, strict=False) left out: " + "; ".join(problems),
                      stacklevel=2)
    return dict(small["values"])


def _match(model_state: ModelState, manifest: dict) -> tuple[set[str], list[str]]:
    """The names to load, and what does not match (missing, unexpected, reshaped)."""
    saved = under(MODEL, manifest["tensors"])
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
    return names, mismatches(missing, unexpected, reshaped)


# -- export -----------------------------------------------------------------------------------
def export(path, model, dtype=None, max_shard_size=None, merge_lora=False, adapter=False) -> str:
    """Write the full weights of `px.unwrap(model)` (fp32 masters for trained parameters, the
    original dtypes elsewhere) to one safetensors file under the module's own names, loadable
    with `model.load_state_dict(safetensors.torch.load_file(path))`. A collective: rank 0
    writes, one tensor at a time, a sharded tensor piece by piece from the ranks that hold
    its pieces, so no rank ever holds a copy of the model.

    `dtype=` (a floating torch dtype) casts every floating tensor to it. `max_shard_size=`
    ("5GB", "500MB" or a number of bytes) writes Hugging Face's sharded layout into the
    directory `path` instead: `model-00001-of-0000N.safetensors` files and
    `model.safetensors.index.json`.

    For a LoRA model (PEFT's `get_peft_model`, or a model of the same shape), `merge_lora=True`
    writes the merged model under the base model's names, as PEFT's `merge_and_unload()` would
    give it (each LoRA layer's base weight W + (B @ A) * scaling, with the `scaling` its LoRA
    layer holds; no `base_model.model.` prefix, no `base_layer.`, no adapter tensors; a
    `modules_to_save` module as its trained copy), which `from_pretrained` of the base
    architecture loads; still streamed, each piece of a base weight merged on rank 0 as it
    arrives. What it cannot merge (LoRA on a layer other than nn.Linear, several active
    adapters, DoRA, lora_bias) is refused on every rank before anything is written.
    `adapter=True` (or an adapter's name) writes the adapter alone into the directory `path`
    as PEFT's `save_pretrained` does: `adapter_model.safetensors` under PEFT's keys, and
    `adapter_config.json` when the model carries a `peft_config`."""
    # [Note: an export streams] in export.py; [Note: a LoRA model exported] in lora.py
    call = "px.export(path, model)"
    example = "px.export('model.safetensors', model)"
    check_path(call, path, "the file to write", example)
    check_model(call, model, example)
    limit = check_options(call, path, dtype, max_shard_size, merge_lora, adapter)
    state = ModelState(model)
    comm = state.comm
    shapes = state.shapes()
    config = None
    if merge_lora:  # refused alike on every rank, before any collective
        entries = merged_entries(call, state.module, state.names, state.aliases, shapes, dtype)
    elif adapter is not False:
        keys = list(state.module.state_dict(keep_vars=True))
        entries, name = adapter_entries(call, keys, state.aliases, shapes, dtype, adapter,
                                        configured(state.module))
        check_config(call, peft_config(state.module, name))
        config = adapter_config(state.module, name)
    else:
        entries = []
        for name in state.module.state_dict(keep_vars=True):
            source = state.aliases.get(name, name)
            shape, held = shapes[source]
            entries.append(Entry(name, source, shape, output_dtype(held, dtype)))
    target = os.path.abspath(os.fspath(path))
    problem = None
    if comm.rank == 0:
        if adapter is not False:
            problem = why_not_directory(target, "with adapter=") or _made(target) or \
                why_not_export_target(os.path.join(target, ADAPTER_FILE))
        else:
            problem = why_not_export_target(target) if limit is None else \
                why_not_directory(target)
    agree(comm, problem, f"px.export({os.fspath(path)!r})")
    owner = {name: 0 for name in state.writer_of()}  # what every rank holds whole: rank 0's

    buffer = [torch.empty(0, dtype=torch.uint8, device=comm.device)]

    def received(n: int, dtype: torch.dtype) -> torch.Tensor:
        """Where a broadcast piece lands: one buffer for the whole export, grown to the largest
        piece (a fresh tensor for each piece would raise the peak by several pieces, as the
        allocator and the collectives release them later)."""
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        if buffer[0].numel() < nbytes:
            buffer[0] = None
            buffer[0] = torch.empty(nbytes, dtype=torch.uint8, device=comm.device)
        return buffer[0][:nbytes].view(dtype)

    def stream(name: str, dtype: torch.dtype):
        """Tensor `name`'s pieces in `dtype`, on rank 0 (on the others: their part in the
        collectives)."""
        if name in owner:  # held whole: written from rank 0's own copy
            yield from _held(state, name, dtype) if comm.rank == 0 else []
            return
        # sharded: rank 0 writes its own pieces, then each other piece in turn, broadcast by
        # the rank that holds it (every rank learns the pieces' places first)
        mine = _held(state, name, dtype) if state.writes_shards else []
        places = comm.all_gather_object([(start, v.numel()) for start, v in mine],
                                        tag="export")
        if comm.rank == 0:
            yield from mine
        for rank, spans in enumerate(places[1:], start=1):
            for i, (start, n) in enumerate(spans):
                if (start, n) in places[0]:  # the same piece as rank 0's (DiLoCo's whole values)
                    continue
                if comm.rank == rank:
                    piece = mine[i][1].to(comm.device)
                else:
                    piece = received(n, dtype)
                comm.broadcast(piece, src=rank, tag="export")
                if comm.rank == 0:
                    yield start, piece.cpu()
                del piece

    def whole(name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """Tensor `name` whole on rank 0 (a LoRA adapter's A or B), None elsewhere."""
        shape = shapes[name][0]
        out = torch.empty(shape, dtype=dtype) if comm.rank == 0 else None
        for start, values in stream(name, dtype):
            out.view(-1)[start:start + values.numel()] = values
        return out

    def pieces(entry: Entry):
        if entry.merge is None:
            yield from stream(entry.source, entry.dtype)
            return
        # a LoRA layer's base weight: A and B first, then each piece of W merged on rank 0 as
        # it arrives ([Note: a LoRA model exported] in lora.py)
        a, b = whole(entry.merge.a, entry.merge.dtype), whole(entry.merge.b, entry.merge.dtype)
        for start, values in stream(entry.source, shapes[entry.source][1]):
            yield from merged(start, values, entry.shape[1], a, b, entry.merge)

    if adapter is not False:
        error = write_plan(os.path.join(target, ADAPTER_FILE), [entries], pieces,
                           comm.rank == 0, False)
        if comm.rank == 0 and error is None and config is not None:
            error = _tried(lambda: write_config(target, config))
    else:
        error = write_plan(target, plan(entries, limit), pieces, comm.rank == 0,
                           limit is not None)
    agree(comm, error, f"px.export({os.fspath(path)!r})")
    return os.fspath(path)


def _made(directory: str) -> str | None:
    """Make `directory` (with its parents); the error, or None."""
    return _tried(lambda: os.makedirs(directory, exist_ok=True))


def _tried(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - agreed on by every rank by the caller
        return f"{type(exc).__name__}: {exc}"
    return None


@torch.no_grad()
def _held(state: ModelState, name: str, dtype: torch.dtype) -> list[tuple[int, torch.Tensor]]:
    """This rank's pieces of tensor `name` as (first element, 1-D values in `dtype`) on the
    CPU, as `ModelState.ranges` reads them: views where no cast is needed."""
    t = state.tensors[name]
    saved_as = state.saved_as.get(id(t))
    if saved_as is not None:  # a part's value for it (DiLoCo: the last sync's weights)
        held = [(0, saved_as)]
    elif name in state.pieces:  # a frozen shard is in the compute dtype: widened first
        held = [(p.start, p.master) for p in state.pieces[name]]
    else:
        held = [(0, t)]
    out = []
    for start, values in held:
        values = values.detach().reshape(-1).cpu().to(state.dtype_of(name))
        out.append((start, values.to(dtype)))
    return out


def export_checkpoint(checkpoint, out, dtype=None, max_shard_size=None, merge_lora=False,
                      adapter=False) -> str:
    """`phalanx export CKPT OUT`: the model's full weights from a checkpoint, offline (no
    process group), as one safetensors file, or with `max_shard_size` as Hugging Face's
    sharded layout in the directory OUT; read and written one tensor at a time. `adapter=`
    writes a LoRA adapter alone as `px.export(..., adapter=)` does, without adapter_config.json
    (a checkpoint holds no LoRA configuration); `merge_lora=True` is refused, as a checkpoint
    does not record the LoRA scaling (export from the running model)."""
    call = "phalanx export CKPT OUT"
    limit = check_options(call, out, dtype, max_shard_size, merge_lora, adapter)
    checkpoint = os.path.abspath(os.fspath(checkpoint))
    target = os.path.abspath(os.fspath(out))
    if adapter is not False:
        problem = why_not_directory(target, "with --adapter") or \
            why_not_export_target(os.path.join(target, ADAPTER_FILE))
    else:
        problem = why_not_export_target(target) if limit is None else why_not_directory(target)
    if problem is not None:
        raise CheckpointError(problem)
    manifest = read_manifest(checkpoint)
    saved = under(MODEL, manifest["tensors"])
    names = {name: name for name in saved}
    names.update(manifest.get("aliases", {}))  # tied weights, under both names
    shapes = {name: (list(v["shape"]), getattr(torch, v["dtype"])) for name, v in saved.items()}
    if merge_lora:
        lora = [n for n in names if ".lora_A." in n or ".lora_B." in n]
        raise ValueError(
            f"{call}: --merge-lora needs each LoRA layer's scaling (lora_alpha / r), and a "
            "checkpoint does not record it" + (f" (this one holds {len(lora)} LoRA tensors)"
                                               if lora else " (this one holds no LoRA tensor)")
            + "; export the merged model from the running model instead: "
            "px.export(path, model, merge_lora=True)")
    if adapter is not False:
        entries, _ = adapter_entries(call, list(names), names, shapes, dtype, adapter,
                                     option="--adapter ")
        file, files, sharded = os.path.join(target, ADAPTER_FILE), [entries], False
    else:
        entries = [Entry(name, source, shapes[source][0], output_dtype(shapes[source][1], dtype))
                   for name, source in names.items()]
        file, files, sharded = target, plan(entries, limit), limit is not None
    problems = verify_files(checkpoint, manifest, sorted(manifest["files"]))
    if problems:
        raise CheckpointError("; ".join(problems))
    if adapter is not False:
        os.makedirs(target, exist_ok=True)
    reader = Reader(checkpoint, manifest)
    try:
        error = write_plan(file, files,
                           lambda e: [(0, reader.full(MODEL + e.source).reshape(-1))],
                           True, sharded)
    finally:
        reader.close()
    if error is not None:
        raise CheckpointError(error)
    return os.fspath(out)


def full_weights(checkpoint: str) -> dict:
    """The model's full weights in the checkpoint directory `checkpoint`, every rank's shards
    joined, read in this process alone (no process group), once every file has verified; a tied
    weight under each of its names."""
    manifest = read_manifest(checkpoint)
    problems = verify_files(checkpoint, manifest, sorted(manifest["files"]))
    if problems:
        raise CheckpointError("; ".join(problems))
    reader = Reader(checkpoint, manifest)
    try:
        full = {name: reader.full(MODEL + name) for name in under(MODEL, manifest["tensors"])}
    finally:
        reader.close()
    for alias, name in manifest.get("aliases", {}).items():  # tied weights, under both names
        full[alias] = full[name].clone()
    return full
