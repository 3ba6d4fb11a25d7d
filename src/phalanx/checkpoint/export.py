"""`px.export` and `phalanx export` as a stream: one tensor at a time, never the whole model.

[Note: an export streams]
The safetensors layout (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes in that order) is known before any value
is: the names, shapes and dtypes give every byte range. So the writer (rank 0) writes the header
first and then each tensor's bytes as they arrive, one piece at a time, each at its place in
the file: a tensor held whole is written from rank 0's own copy; a sharded one from rank 0's own
pieces and then from each other rank's pieces in turn, which the holder broadcasts (cast to the
output dtype where it is held) once every rank has learnt the pieces' places. What the export
adds to rank 0's memory is one piece of one tensor, not a copy of the model. Every rank walks
the same plan in the same order, so the collectives match; an error on rank 0 stops its
writing, not its part in the collectives, and is raised on every rank at the end. A LoRA
layer's base weight in a merged export streams the same way, each piece merged on rank 0 as it
arrives ([Note: a LoRA model exported] in lora.py).

With `max_shard_size` the output is Hugging Face's sharded layout in a directory:
`model-00001-of-0000N.safetensors` files, the tensors in the module's order, a new file begun
when the next tensor would take the current one past `max_shard_size` (a tensor is never split;
one larger than the limit has a file of its own), and `model.safetensors.index.json`
({"metadata": {"total_size": bytes}, "weight_map": {name: file}}), written last.
"""

from __future__ import annotations

import json
import os
import re
import struct
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..planner.sizes import parse_bytes
from .common import STATE_FILE
from .files import DTYPE_NAMES, _bytes_of, fsync_dir, write_text
from .removal import why_not_export_target

__all__ = ["Entry", "check_options", "plan", "write_plan", "INDEX"]

INDEX = "model.safetensors.index.json"
# safetensors' names of the dtypes: a checkpoint's (files.py), and those only an export meets
_NAMES = dict(DTYPE_NAMES)
for _torch_name, _name in [("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                           ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")]:
    if hasattr(torch, _torch_name):
        _NAMES[getattr(torch, _torch_name)] = _name
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass
class Entry:
    """One tensor of the output: its name there, the name of the tensor that holds its values
    (another for a tied weight's later name), its shape and its dtype in the file; and for a
    LoRA layer's base weight in a merged export, the merge of its adapter (lora.py)."""
    name: str
    source: str
    shape: list[int]
    dtype: torch.dtype
    merge: object = None  # lora.py's Merge (which imports this module), or None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def check_options(call: str, path, dtype, max_shard_size, merge_lora,
                  adapter=False) -> int | None:
    """The export's keyword arguments checked (the same answer on every rank, before any
    collective); `max_shard_size` in bytes, or None for one file."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point
                                  and dtype in DTYPE_NAMES):
        raise TypeError(f"{call}: dtype= takes a floating torch dtype (torch.float32, "
                        f"torch.bfloat16, torch.float16, torch.float64) or None for the saved "
                        f"dtypes, not {dtype!r}")
    if merge_lora not in (True, False):
        raise TypeError(f"{call}: merge_lora= takes True or False, not {merge_lora!r}")
    if not isinstance(adapter, (bool, str)) or adapter == "":
        raise TypeError(f"{call}: adapter= takes True (the model's one adapter), an adapter's "
                        f"name (adapter='default') or False, not {adapter!r}")
    if adapter is not False:
        if merge_lora:
            raise ValueError(f"{call}: merge_lora=True writes the merged model and adapter= "
                             "the adapter alone: choose one (two exports write both)")
        if max_shard_size is not None:
            raise ValueError(f"{call}: adapter= writes one adapter_model.safetensors, as PEFT "
                             "does, and takes no max_shard_size")
        if os.fspath(path).endswith(".safetensors"):
            raise ValueError(f"{call}: adapter= writes a directory, as PEFT's save_pretrained "
                             f"does (adapter_model.safetensors, adapter_config.json), and "
                             f"{os.fspath(path)!r} names a .safetensors file: name a directory")
        return None
    if max_shard_size is None:  # one file (a directory is refused as before: removal.py)
        return None
    try:
        limit = parse_bytes(max_shard_size, "max_shard_size")
    except ValueError as exc:
        raise ValueError(f"{call}: {exc}; max_shard_size takes e.g. '5GB', '500MB' or a "
                         "number of bytes") from None
    if limit <= 0:
        raise ValueError(f"{call}: max_shard_size={max_shard_size!r} must be above 0 bytes: "
                         "write e.g. max_shard_size='5GB'")
    if os.fspath(path).endswith(".safetensors"):
        raise ValueError(f"{call}: max_shard_size= writes Hugging Face's sharded layout into a "
                         f"directory, and {os.fspath(path)!r} names a .safetensors file: name "
                         "a directory, or leave out max_shard_size for one file")
    return limit


def plan(entries: list[Entry], limit: int | None) -> list[list[Entry]]:
    """The entries by output file: all in one without a limit, else Hugging Face's rule."""
    if limit is None:
        return [entries]
    files: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


def output_dtype(dtype: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    """`wanted` for a floating tensor when given, else the tensor's own dtype."""
    return wanted if wanted is not None and dtype.is_floating_point else dtype


def why_not_directory(path: str, how: str = "with max_shard_size") -> str | None:
    """None when a sharded (or an adapter's) export may write into directory `path`."""
    if os.path.lexists(path) and not os.path.isdir(path):
        return (f"{path} exists and is not a directory; {how} px.export writes "
                "a directory of safetensors files: name a directory")
    if os.path.exists(os.path.join(path, STATE_FILE)):
        return (f"{path} is a checkpoint (px.save); px.export does not write into one: "
                "choose another directory")
    return None


Pieces = Callable[[Entry], Iterator[tuple[int, torch.Tensor]]]


def write_plan(target: str, files: list[list[Entry]], pieces: Pieces, writer: bool,
               sharded: bool) -> str | None:
    """Write `files` (from `plan`) to `target`: one file, or the sharded layout in directory
    `target`. `pieces(entry)` is run through on every rank for every entry in order (it may
    hold collectives) and yields, on the writer, (first element, 1-D values in the entry's
    dtype) for each piece of the tensor, each written before the next is asked for. Returns
    the writer's error, or None."""
    unknown = [f"{e.name} ({e.dtype})" for f in files for e in f if e.dtype not in _NAMES]
    if unknown:  # on every rank alike, before any collective
        raise TypeError("px.export: safetensors has no name for the dtype of "
                        + ", ".join(unknown) + "; convert them to a dtype it names (float, "
                        "integer, bool, float8) before the export")
    error = None
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    if writer and sharded:
        try:
            os.makedirs(target, exist_ok=True)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    for name, entries in zip(names, files):
        path = os.path.join(target, name) if sharded else target
        out = _File(path, entries) if writer and error is None else None
        if out is not None:
            error = out.begin()
        for entry in entries:
            for start, values in pieces(entry):  # on every rank: it drives the collectives
                if out is not None and error is None:
                    error = out.write(entry, start, values)
        if out is not None:
            error = out.end(error)
    if writer and sharded and error is None:
        try:
            _write_index(target, files, names)
        except Exception as exc:  # noqa: BLE001 - agreed on by every rank by the caller
            error = f"{type(exc).__name__}: {exc}"
    return error


class _File:
    """One safetensors file written as a stream: header, then each tensor's pieces at their
    places, to a temporary name renamed over `path` once whole."""

    def __init__(self, path: str, entries: list[Entry]):
        self.path = path
        self.tmp = f"{path}.partial-{uuid.uuid4().hex[:12]}"
        self.offsets, offset = {}, 0
        header: dict = {"__metadata__": {"format": "pt"}}
        for entry in entries:
            header[entry.name] = {"dtype": _NAMES[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [offset, offset + entry.nbytes]}
            self.offsets[entry.name] = offset
            offset += entry.nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes
        self.head = struct.pack("<Q", len(head)) + head
        self.size = len(self.head) + offset
        self.f = None

    def begin(self) -> str | None:
        try:
            self.f = open(self.tmp, "wb")
            self.f.write(self.head)
            self.f.truncate(self.size)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return None

    def write(self, entry: Entry, start: int, values: torch.Tensor) -> str | None:
        """The 1-D `values` as the elements from `start` on of `entry`'s tensor."""
        try:
            size = torch.empty((), dtype=entry.dtype).element_size()
            self.f.seek(len(self.head) + self.offsets[entry.name] + start * size)
            self.f.write(_bytes_of(values.to(entry.dtype)))
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return None

    def end(self, error: str | None) -> str | None:
        try:
            if self.f is not None:
                self.f.flush()
                os.fsync(self.f.fileno())
                self.f.close()
            if error is None:
                problem = why_not_export_target(self.path)  # again, just before the rename
                if problem is not None:
                    return problem
                os.replace(self.tmp, self.path)
                fsync_dir(os.path.dirname(self.path) or ".")
        except Exception as exc:  # noqa: BLE001
            error = error or f"{type(exc).__name__}: {exc}"
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)
        return error


def _write_index(directory: str, files: list[list[Entry]], names: list[str]) -> None:
    """The index, written last; then the shards of an earlier export that it does not name."""
    index = {"metadata": {"total_size": sum(e.nbytes for f in files for e in f)},
             "weight_map": {e.name: name for name, f in zip(names, files) for e in f}}
    write_text(os.path.join(directory, INDEX), json.dumps(index, indent=2) + "\n")
    for old in os.listdir(directory):
        if _SHARD.fullmatch(old) and old not in names:
            os.remove(os.path.join(directory, old))
    fsync_dir(directory)
