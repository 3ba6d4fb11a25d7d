"""Pretrained weights from Hugging Face-format safetensors, read into a model while `px.prepare`
gives it storage: `px.prepare(meta_model, opt, strategy="zero3", init=px.from_safetensors(path))`.

Why a value of `init=` rather than a load after prepare: a zero3 model built on the meta device
would otherwise first be given values (each module's reset_parameters, module by module) only
to have them overwritten; here nothing is drawn, the files are checked against the model before
anything gets storage (a mismatch leaves the model as it was, on every rank), and the same value
serves every strategy and a model not built on meta alike.

[Note: reading only what a rank keeps]
`plan` runs on every rank before the model is given storage: the files' names and shapes
against the model's `state_dict()` (a tied parameter, registered under several names, needs
one of them: Hugging Face writes `model.embed_tokens.weight` and leaves out the tied
`lm_head.weight`), each rank's verdict exchanged, so that a missing, extra or mis-shaped key
is the same ValueError on every rank and no rank goes on to wait in a collective. Then:
  - `load`, before the engine is built: every tensor with storage on this rank is read whole.
    That is all of them under ddp, zero1, zero2, one process, or a model not built on meta;
    under zero3 the buffers, which materialize.py gives storage, while the (floating)
    parameters have no room (a zero stride) and wait for:
  - `load_pieces`, after the engine is built: each piece this rank owns, of a trainable
    parameter's master or of a frozen one's shard (`engine.held_pieces()`:
    `param.view(-1)[start:end]`), is read as the rows of dim 0 that cover it
    (`safe_open(...).get_slice(name)[first:last]`), so a rank reads its share of the file plus
    at most two partial rows per piece, and holds its shards plus one piece's rows.
  - safetensors gives a tensor as a view of the whole file mapped into memory, and every page
    read stays in the process's resident set until the file is closed: each tensor is read
    with the file opened for it alone, so at most one tensor's pages of the file are resident
    at once (kept open, a rank reading half of a file would hold those pages beside its
    masters, as much as the whole model in all).
  - A non-persistent buffer built on meta (a rotary embedding's `inv_freq`) is in no file: its
    module's own initialisation computes it, `reset_parameters()` or else a Hugging Face
    model's `_init_weights(module)` (the nearest ancestor's), with the parameters of the
    module's tree swapped for meta stand-ins so nothing but buffers is written, and the
    generator put back after. This runs before the files are read, so a persistent buffer the
    same call resets takes the file's value.
Values are copied into each tensor in its own dtype, before any cast for the precision: a
bf16 file into an fp32 model gives fp32 masters holding the bf16 values exactly, and bf16
compute then casts them as it casts any fp32 model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from .materialize import has_room

__all__ = ["from_safetensors", "PretrainedWeights"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def from_safetensors(path: str | os.PathLike) -> PretrainedWeights:
    """Pretrained weights in Hugging Face's safetensors format, for `px.prepare(..., init=...)`.

    `path`: a directory holding `model.safetensors.index.json` (a model split over several
    files) or `model.safetensors` (what `save_pretrained` writes), or one of those files.

        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model, optimizer = px.prepare(model, optimizer, strategy="zero3",
                                      init=px.from_safetensors("path/to/model"))

    The files' names are the model's `state_dict()` keys; a tied parameter needs one of its
    names (Hugging Face leaves `lm_head.weight` out when it is tied to the embedding). Every
    rank checks the files against the model before anything is read: a key missing from the
    files, one the model does not have, or a shape that differs is a ValueError on every rank
    naming the keys, and the model is left as it was. Under zero3 each rank reads only the
    rows of each tensor that cover the slices it owns; under ddp, zero1 and zero2 every rank
    reads the tensors whole. A non-persistent buffer built on the meta device (a rotary
    embedding's `inv_freq`) is in no file: its module's `reset_parameters()` computes it, or,
    in a Hugging Face model, the model's `_init_weights`. Each value is copied into its
    tensor's own dtype, before any cast for the precision (a bf16 file and an fp32 model give
    fp32 masters holding the bf16 values exactly). A model not built on meta is loaded in
    place on every rank, with no broadcast.

    The object returned is also an `fn(model)` that loads the files into a model whole, and
    counts in `read_bytes` the bytes of tensor data it has read.
    """
    return PretrainedWeights(path)


@dataclass
class _Entry:
    """One tensor of the model: its state_dict names (several when tied), where it is
    registered, and the name and file it is read from."""
    names: list[str]
    module: str
    attr: str
    parameter: bool
    shape: tuple
    key: str | None = None
    file: str | None = None


class PretrainedWeights:
    """Returned by `px.from_safetensors`; see there."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.read_bytes = 0

    def __repr__(self) -> str:
        return f"px.from_safetensors({self.path!r})"

    def __call__(self, model: nn.Module) -> None:
        """Load the files into `model` (with storage) whole, in one process."""
        self.plan(model).load()

    def plan(self, model: nn.Module, comm=None) -> Reading:
        """Check the files against `model` (see [Note: reading only what a rank keeps]); every
        rank raises the same ValueError if any rank's check failed (a collective over `comm`)."""
        problem, plan = None, None
        try:
            plan, problem = self._plan(model)
        except Exception as exc:  # noqa: BLE001 (said on every rank, not left to hang them)
            problem = f"{self!r}: {type(exc).__name__}: {exc}"
        _agree(problem, comm)
        return plan

    def _plan(self, model: nn.Module) -> tuple[Reading | None, str | None]:
        try:
            files = _tensor_files(self.path)
            shapes = _shapes(files)
        except Exception as exc:  # noqa: BLE001 (a file missing, unreadable, not safetensors)
            return None, f"{self!r} cannot be read: {type(exc).__name__}: {exc}"
        problems: list[str] = []
        entries = _entries(model, problems)
        computed = _computed(model, problems)
        known = {name for e in entries for name in e.names}
        missing, wrong = [], []
        for e in entries:
            present = [name for name in e.names if name in shapes]
            if not present:
                missing.append(repr(e.names[0]) + "".join(f" (tied: or {n!r})"
                                                           for n in e.names[1:]))
            for name in present:
                if shapes[name] != e.shape:
                    wrong.append(f"{name!r} is {list(shapes[name])} in the files but "
                                 f"{list(e.shape)} in the model")
            e.key = present[0] if present else None
            e.file = files.get(e.key)
        extra = [repr(key) for key in sorted(shapes) if key not in known]
        keys = [f"{len(names)} {'key' if len(names) == 1 else 'keys'} {what}: {_listed(names)}"
                for what, names in (("missing from the files", missing),
                                    ("in the files but not in the model", extra),
                                    ("of another shape", wrong)) if names]
        if keys:
            problems.append("; ".join(keys) + ". The files' names must be the model's "
                            "state_dict() keys (a tied parameter needs one of its names): build "
                            "the model from the configuration the files were saved with")
        if problems:
            return None, f"{self!r} does not fit the model, so nothing was loaded: " + \
                "; ".join(problems)
        return Reading(self, model, entries, computed), None


@dataclass
class Reading:
    """The files checked against one model (`PretrainedWeights.plan`): its tensors, each with
    the name and file it is read from, and the modules whose own initialisation computes their
    non-persistent buffers (with the ancestor whose `_init_weights` does it; None: the module's
    `reset_parameters`). Modules are found by their path from `root`, the parameters themselves
    being replaced as the model is given storage."""
    weights: PretrainedWeights
    root: nn.Module
    entries: list[_Entry]
    computed: list[tuple[str, str | None]]
    later: list[_Entry] | None = None  # what `load` found no room for

    @torch.no_grad()
    def load(self) -> None:
        """Compute the non-persistent buffers built on meta, then read whole every tensor that
        has storage on this rank (all but zero3's trainable parameters, left for
        `load_pieces`)."""
        _compute(self.root, self.computed)
        self.later = []
        for e in self.entries:
            t = self._tensor(e)
            if not has_room(t):
                self.later.append(e)
                continue
            # one tensor per opening: see [Note: reading only what a rank keeps]
            with safe_open(e.file, framework="pt") as f:
                value = f.get_tensor(e.key)
                self.weights.read_bytes += value.numel() * value.element_size()
                t.copy_(value)
                del value

    @torch.no_grad()
    def load_pieces(self, pieces: dict) -> None:
        """zero3: read into each piece this rank owns (`pieces`: the engine's `held_pieces()`)
        the rows of dim 0 that cover it, for every parameter `load` left."""
        for e in self.later:
            t = self._tensor(e)
            if id(t) not in pieces:
                raise RuntimeError(f"{e.names[0]!r} has no storage and no master on this rank: "
                                   "there is nothing to read it into")
            if not pieces[id(t)]:
                continue  # this rank owns none of it
            with safe_open(e.file, framework="pt") as f:
                for piece in pieces[id(t)]:
                    piece.master.view(-1).copy_(self._read(f, e, piece.start, piece.end))

    def _read(self, f, e: _Entry, start: int, end: int) -> torch.Tensor:
        """`tensor.view(-1)[start:end]` of `e`, reading only the whole rows of dim 0 that hold
        it."""
        row = math.prod(e.shape[1:])
        first, last = start // row, -(-end // row)
        rows = f.get_slice(e.key)[first:last].reshape(-1)
        self.weights.read_bytes += rows.numel() * rows.element_size()
        return rows[start - first * row:end - first * row]

    def _tensor(self, e: _Entry) -> torch.Tensor:
        module = self.root.get_submodule(e.module)
        return (module._parameters if e.parameter else module._buffers)[e.attr]


def _tensor_files(path: str) -> dict[str, str]:
    """Each tensor's name in the files -> the file that holds it."""
    if os.path.isdir(path):
        for name in (INDEX, SINGLE):
            if os.path.isfile(os.path.join(path, name)):
                return _tensor_files(os.path.join(path, name))
        raise FileNotFoundError(f"the directory has neither {INDEX} nor {SINGLE}")
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path} has no weight_map (the index of a model split over files)")
        base = os.path.dirname(path)
        return {key: os.path.join(base, file) for key, file in weight_map.items()}
    with safe_open(path, framework="pt") as f:
        return {key: path for key in f.keys()}


def _shapes(files: dict[str, str]) -> dict[str, tuple]:
    """Each tensor's shape, from the files' headers (no tensor data is read)."""
    shapes = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            held = set(f.keys())
            for key in [k for k, v in files.items() if v == file]:
                if key not in held:
                    raise ValueError(f"the index names {key!r} in {os.path.basename(file)}, "
                                     "which does not hold it")
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _entries(model: nn.Module, problems: list[str]) -> list[_Entry]:
    """The model's state_dict tensors, one entry per tensor (its tied names together)."""
    where: dict[int, tuple[str, str, bool]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for parameter, tensors in ((True, module._parameters), (False, module._buffers)):
            for attr, t in tensors.items():
                if t is not None:
                    where.setdefault(id(t), (path, attr, parameter))
    entries: dict[int, _Entry] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue  # a module's extra state: not a tensor of the files
        if id(t) not in where:
            problems.append(f"the state_dict key {name!r} is neither a parameter nor a buffer "
                            "of the model (a state_dict hook made it), and from_safetensors "
                            "reads into parameters and buffers only")
        elif id(t) in entries:
            entries[id(t)].names.append(name)
        else:
            entries[id(t)] = _Entry([name], *where[id(t)], tuple(t.shape))
    return list(entries.values())


def _computed(model: nn.Module, problems: list[str]) -> list[tuple[str, str | None]]:
    """The modules with a non-persistent buffer on the meta device, and what computes it."""
    out: dict[str, str | None] = {}
    for path, module in model.named_modules():
        for attr, b in module._buffers.items():
            if b is None or not b.is_meta or attr not in module._non_persistent_buffers_set \
                    or path in out:
                continue
            if callable(getattr(module, "reset_parameters", None)):
                out[path] = None
                continue
            owner = next((a for a in _ancestors(path)
                          if callable(getattr(model.get_submodule(a), "_init_weights", None))),
                         None)
            if owner is None:
                problems.append(
                    f"the buffer {_join(path, attr)!r} is not saved with the model "
                    f"(non-persistent) and is on the meta device, and "
                    f"{type(module).__name__} has no reset_parameters() to compute it: give it "
                    "one, or build that module on a real device")
            else:
                out[path] = owner
    return list(out.items())


@torch.no_grad()
def _compute(model: nn.Module, computed: list[tuple[str, str | None]]) -> None:
    """See [Note: reading only what a rank keeps]: each module's own initialisation computes
    its non-persistent buffers; the parameters of its tree are meta stand-ins meanwhile."""
    for path, owner in computed:
        module = model.get_submodule(path)
        real = {(m, a): p for m in module.modules() for a, p in m._parameters.items()
                if p is not None}
        rng = torch.get_rng_state()
        for (m, a), p in real.items():
            m._parameters[a] = nn.Parameter(torch.empty_like(p, device="meta"),
                                            requires_grad=p.requires_grad)
        try:
            if owner is None:
                module.reset_parameters()
            else:
                model.get_submodule(owner)._init_weights(module)
        except Exception as exc:
            how = "reset_parameters()" if owner is None else \
                f"{type(model.get_submodule(owner)).__name__}._init_weights"
            raise RuntimeError(f"computing the non-persistent buffers of {path or 'the model'!r} "
                               f"({type(module).__name__}) with its {how} failed: {exc}") from exc
        finally:
            for (m, a), p in real.items():
                m._parameters[a] = p
            torch.set_rng_state(rng)


def _agree(problem: str | None, comm) -> None:
    """Raise on every rank if any rank found a problem (one exchange over `comm`)."""
    problems = [problem] if comm is None or comm.world == 1 else \
        comm.all_gather_object(problem, tag="prepare:pretrained weights")
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if not failed:
        return
    rank, first = failed[0]
    if len(failed) == len(problems) and all(p == first for _, p in failed):
        raise ValueError(first)
    raise ValueError(f"on rank {rank}: {first}")


def _ancestors(path: str) -> list[str]:
    """`path` itself, then each module above it, up to the root ("")."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _join(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr


def _listed(names: list[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
