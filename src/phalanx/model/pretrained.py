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
compute then casts them as it casts any fp32 model. Only where that dtype holds every value of
the file's exactly (`exact_cast`): any other cast would change values, so `plan` refuses it.

A PEFT model reads the files of its base model, as
[Note: a PEFT model reads the plain model's files] in model/peft_names.py says: which name of
the files each of its tensors is read from, which of its parameters are adapters that no file
has, and how those are drawn on meta (by model/materialize.py's `draw_modules`, zero3's into
the pieces each rank owns after `load_pieces`); not on meta, an adapter keeps its values, rank
0's (`share_kept`).
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
from .peft_names import Adapters, adapter_scope, ancestors, file_names, listed

__all__ = ["from_safetensors", "PretrainedWeights"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# safetensors' names of its dtypes (the header's "dtype"); float8 and unsigned where torch has
# them
_FILE_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("I16", "int16"), ("U16", "uint16"),
    ("I32", "int32"), ("U32", "uint32"), ("I64", "int64"), ("U64", "uint64"),
    ("F16", "float16"), ("BF16", "bfloat16"), ("F32", "float32"), ("F64", "float64"),
    ("C64", "complex64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
    if hasattr(torch, attr)}


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
    fp32 masters holding the bf16 values exactly), and only where that dtype holds every value
    of the file's: the same dtype, or a float into a wider float (bf16 or fp16 into fp32, fp32
    into fp64), an integer into a wider integer. An integer into a float or back, and a
    narrower dtype (fp64 into fp32, fp32 into bf16), would change values: such a tensor is a
    ValueError on every rank, naming it and both dtypes, before anything is read. A model not
    built on meta is loaded in place on every rank, with no broadcast of what the files hold.

    A PEFT model reads the base model's files: `get_peft_model(base, LoraConfig(...))` names
    `q_proj.weight` `base_model.model.….q_proj.base_layer.weight`, and that is read from
    `….q_proj.weight` (prompt learning's `base_model.` and the `modules_to_save` copies too).
    Its adapters are in no file: built on meta, they are drawn as `get_peft_model` draws them
    (each adapter module's `reset_parameters()`, then PEFT's LoRA initialisation, B zero), from
    rank 0's generator; not on meta they keep rank 0's values. A LoRA initialisation that
    reads the base weights (`init_lora_weights="pissa"`, "olora", ...) is refused on meta.

    `px.prepare(..., init="path")` (a str or os.PathLike) means `init=px.from_safetensors(
    "path")`. The object returned is also an `fn(model)` that loads the files into a model
    whole, and counts in `read_bytes` the bytes of tensor data it has read.
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
    dtype: torch.dtype
    key: str | None = None
    file: str | None = None


class PretrainedWeights:
    """Returned by `px.from_safetensors`; see there."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.read_bytes = 0

    def __repr__(self) -> str:
        return f"px.from_safetensors({self.path!r})"

    @staticmethod
    def of(init) -> PretrainedWeights | None:
        """px.prepare's `init=` as pretrained weights: `px.from_safetensors(path)` itself, or a
        path (str or os.PathLike) standing for it; None for an init function or None."""
        if isinstance(init, PretrainedWeights):
            return init
        if isinstance(init, (str, os.PathLike)):
            return PretrainedWeights(init)
        return None

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
            headers = _headers(files)
        except Exception as exc:  # noqa: BLE001 (a file missing, unreadable, not safetensors)
            return None, f"{self!r} cannot be read: {type(exc).__name__}: {exc}"
        problems: list[str] = []
        entries = _entries(model, problems)
        computed = _computed(model, problems)
        adapter = adapter_scope(model)
        known, missing, wrong, casts, lacking = set(), [], [], [], []
        for e in entries:
            # see [Note: a PEFT model reads the plain model's files] in peft_names.py
            names = [file_names(name) for name in e.names]
            known.update(key for candidates in names for key in candidates)
            present = list(dict.fromkeys(key for candidates in names for key in candidates
                                         if key in headers))
            if not present and e.parameter and all(map(adapter, e.names)):
                lacking.append((e.module, e.attr))  # an adapter's
            elif not present:
                said = [repr(name) + (f" (in the files: {candidates[1]!r})"
                                      if len(candidates) > 1 else "")
                        for name, candidates in zip(e.names, names)]
                missing.append(said[0] + "".join(f" (tied: or {n})" for n in said[1:]))
            for key in present:
                shape, dtype = headers[key]
                if shape != e.shape:
                    wrong.append(f"{key!r} is {list(shape)} in the files but {list(e.shape)} "
                                 "in the model")
                elif not exact_cast(_FILE_DTYPES.get(dtype), e.dtype):
                    casts.append(f"{key!r} is {_dtype_name(_FILE_DTYPES.get(dtype), dtype)} in "
                                 f"the files but {_dtype_name(e.dtype)} in the model")
            e.key = present[0] if present else None
            e.file = files.get(e.key)
        extra = [repr(key) for key in sorted(headers) if key not in known]
        keys = [f"{len(names)} {'key' if len(names) == 1 else 'keys'} {what}: {listed(names)}"
                for what, names in (("missing from the files", missing),
                                    ("in the files but not in the model", extra),
                                    ("of another shape", wrong)) if names]
        if keys:
            problems.append("; ".join(keys) + ". The files' names must be the model's "
                            "state_dict() keys (a tied parameter needs one of its names): build "
                            "the model from the configuration the files were saved with")
        if casts:
            problems.append(
                f"{len(casts)} {'key' if len(casts) == 1 else 'keys'} of a dtype that the "
                f"model's does not hold exactly: {listed(casts)}. A value is copied into its "
                "tensor's own dtype only where that holds every value of the file's (the same "
                "dtype, a float into a wider float such as bf16 into fp32, an integer into a "
                "wider integer), never between integers and floats nor into a narrower dtype: "
                "build the model in the files' dtype (precision= sets the dtype it computes "
                "in), or, if changing the values is what you mean, write the files again in "
                "the model's dtype")
        adapters = Adapters.of(model, lacking, problems)
        if problems:
            return None, f"{self!r} does not fit the model, so nothing was loaded: " + \
                "; ".join(problems)
        return Reading(self, model, entries, computed, adapters), None


@dataclass
class Reading:
    """The files checked against one model (`PretrainedWeights.plan`): its tensors, each with
    the name and file it is read from, and the modules whose own initialisation computes their
    non-persistent buffers (with the ancestor whose `_init_weights` does it; None: the module's
    `reset_parameters`). Modules are found by their path from `root`, the parameters themselves
    being replaced as the model is given storage. `adapters`: the parameters no file has, a
    PEFT model's adapters ([Note: a PEFT model reads the plain model's files] in
    model/peft_names.py)."""
    weights: PretrainedWeights
    root: nn.Module
    entries: list[_Entry]
    computed: list[tuple[str, str | None]]
    adapters: Adapters
    later: list[_Entry] | None = None  # what `load` found no room for

    @torch.no_grad()
    def load(self) -> None:
        """Compute the non-persistent buffers built on meta, then read whole every tensor that
        has storage on this rank (all but zero3's trainable parameters, left for
        `load_pieces`)."""
        _compute(self.root, self.computed)
        self.later = []
        for e in self.entries:
            if e.key is None:
                continue  # an adapter's, in no file: drawn or kept
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

    @torch.no_grad()
    def take_whole(self, module: str, attr: str) -> torch.Tensor | None:
        """The whole tensor `attr` of the module at path `module` that `load` left for the
        shards, read from its file as stored (one tensor), and no longer left: what a caller
        keeps in another form (model/nf4_base.py quantizes it). None if it is not left."""
        for e in self.later or []:
            if e.module == module and e.attr == attr:
                self.later.remove(e)
                with safe_open(e.file, framework="pt") as f:
                    value = f.get_tensor(e.key)
                self.weights.read_bytes += value.numel() * value.element_size()
                return value
        return None

    def share_kept(self, comm) -> None:
        """Rank 0's values of the adapters that were not on meta, on every rank."""
        self.adapters.share_kept(comm)

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


def _headers(files: dict[str, str]) -> dict[str, tuple[tuple, str]]:
    """Each tensor's shape and dtype (safetensors' name for it), from the files' headers (no
    tensor data is read)."""
    headers = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            held = set(f.keys())
            for key in [k for k, v in files.items() if v == file]:
                if key not in held:
                    raise ValueError(f"the index names {key!r} in {os.path.basename(file)}, "
                                     "which does not hold it")
                piece = f.get_slice(key)
                headers[key] = (tuple(piece.get_shape()), piece.get_dtype())
    return headers


def exact_cast(src: torch.dtype | None, dst: torch.dtype) -> bool:
    """Whether every value of dtype `src` is a value of `dst`: the same dtype, or one of the
    same kind (float, integer (bool with them), complex) that promotes to `dst` (bf16 and fp16
    to fp32, int8 to int32, bool to int8; float8 by its range and precision). None: a dtype
    torch does not have."""
    if src is None or src == dst:
        return src is not None
    kind = [(d.is_complex, d.is_floating_point) for d in (src, dst)]
    if kind[0] != kind[1]:
        return False
    try:
        return torch.promote_types(src, dst) == dst
    except RuntimeError:  # torch does not promote float8 types
        a, b = torch.finfo(src), torch.finfo(dst)
        return b.eps <= a.eps and b.max >= a.max and b.smallest_normal <= a.smallest_normal


def _dtype_name(dtype: torch.dtype | None, file_name: str = "") -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else file_name


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
            entries[id(t)] = _Entry([name], *where[id(t)], tuple(t.shape), t.dtype)
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
            owner = next((a for a in ancestors(path)
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


def _join(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr
