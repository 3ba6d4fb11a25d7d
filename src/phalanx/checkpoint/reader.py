"""Reading a checkpoint: its manifest, the integrity of its files, and any range of a tensor."""

from __future__ import annotations

import json
import os
import struct

import torch

from .files import DTYPE_NAMES, file_digest

__all__ = ["MANIFEST", "FORMAT", "CheckpointError", "read_manifest", "verify_files", "Reader",
           "complete_checkpoints", "newest_intact"]

MANIFEST = "manifest.json"
FORMAT = "phalanx-checkpoint"


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded (missing, incomplete, altered, or of another model),
    or cannot be saved where it was asked to go: `px.save(path)` writes only where `path` is
    absent, an empty directory, or a complete checkpoint holding nothing but its own files, so a
    mistyped path cannot cost a directory of the user's (a regular file or a directory holding
    anything else is refused, with its name, on every rank, before anything is written)."""
    # The rules: [Note: a save removes only checkpoints] in removal.py.


def read_manifest(path: str) -> dict:
    where = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: not a directory")
    try:
        with open(where) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete phalanx checkpoint: {MANIFEST} is "
                              "missing (a save that did not finish?); px.latest_checkpoint(dir) "
                              "finds the newest complete one") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {where}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a phalanx checkpoint manifest")
    return manifest


def complete_checkpoints(directory: str) -> list[tuple[float, str]]:
    """(saved_at, path) of every complete checkpoint directly in `directory`, oldest first;
    checkpoints being written (`*.partial-*`) or being replaced (`*.old-*`) are not complete."""
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


def newest_intact(directory: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete checkpoint in `directory` whose every file has the size and CRC-32
    its manifest gives, and the newer ones that do not, newest first, each with why: (path,
    [(path, problems)]). A checkpoint directory whose manifest is there but cannot be read
    counts among those skipped when it is newer than the one returned; with none intact the
    path is None."""
    skipped, chosen_at = [], None
    for saved_at, path in reversed(complete_checkpoints(directory)):
        try:
            manifest = read_manifest(path)
            problems = verify_files(path, manifest, sorted(manifest["files"]))
        except CheckpointError as exc:
            problems = [str(exc)]
        except (KeyError, TypeError, AttributeError) as exc:
            problems = [f"its manifest is malformed ({type(exc).__name__}: {exc})"]
        if not problems:
            chosen_at = saved_at
            break
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            continue  # removed while it was checked (a save's keep_last): gone, not damaged
        skipped.append((saved_at, path, "; ".join(problems)))
    skipped += [entry for entry in _unreadable_manifests(directory)
                if chosen_at is None or entry[0] > chosen_at]
    skipped.sort(reverse=True)
    return (None if chosen_at is None else path), [(p, why) for _, p, why in skipped]


def _unreadable_manifests(directory: str) -> list[tuple[float, str, str]]:
    """(when written, path, why) of each directory in `directory` whose manifest file is
    there but is not a readable phalanx manifest."""
    out = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    for entry in entries:
        where = os.path.join(directory, entry)
        if ".partial-" in entry or ".old-" in entry or \
                not os.path.isfile(os.path.join(where, MANIFEST)):
            continue
        try:
            read_manifest(where)
        except CheckpointError as exc:
            try:
                out.append((os.path.getmtime(os.path.join(where, MANIFEST)), where, str(exc)))
            except OSError:
                pass
    return out


def verify_files(path: str, manifest: dict, which: list[str]) -> list[str]:
    """Problems with the files named in `which`: missing, wrong size, wrong checksum."""
    problems = []
    for name in which:
        info = manifest["files"][name]
        where = os.path.join(path, name)
        try:
            size = os.path.getsize(where)
        except OSError:
            problems.append(f"{where} is missing")
            continue
        if size != info["bytes"]:
            problems.append(f"{where} has {size} bytes, the manifest says {info['bytes']} "
                            "(truncated or rewritten)")
        elif file_digest(where) != info["crc32"]:
            problems.append(f"{where} does not match its checksum (altered or corrupted)")
    return problems


_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class _File:
    """One safetensors file, read by plain reads at byte offsets (its header says where each
    tensor's bytes are) straight into the destination: one copy, into memory the caller owns,
    so nothing loaded keeps a mapping of a file that `keep_last` may delete later. It is not
    faster than safetensors' mapped slices: a 2-rank ddp load of 1.15 GB measured 2.73 s
    through mapped slices and 2.80-2.99 s this way (benchmarks/checkpoint.py), within the
    spread between runs."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        head = os.pread(self.fd, 8, 0)
        if len(head) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (truncated header)")
        (n,) = struct.unpack("<Q", head)
        try:
            self.header = json.loads(os.pread(self.fd, n, 8))
        except ValueError:
            raise CheckpointError(f"{path} is not a safetensors file (bad header)") from None
        self.base = 8 + n

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        """Elements start.. of tensor `key` into `out` (1-D, contiguous, CPU, its dtype)."""
        info = self.header[key]
        if _DTYPES[info["dtype"]] != out.dtype:
            raise CheckpointError(f"{self.path}: {key} is {info['dtype']}, not {out.dtype}")
        size = out.element_size()
        offset = self.base + info["data_offsets"][0] + start * size
        if offset + out.numel() * size > self.base + info["data_offsets"][1]:
            raise CheckpointError(f"{self.path}: {key} has fewer elements than the manifest says")
        view = memoryview(out.detach().view(torch.uint8).numpy()) if out.numel() \
            else memoryview(b"")
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.path} ends before {key} does (truncated)")
            done += n

    def close(self) -> None:
        os.close(self.fd)


class Reader:
    """Elements of saved tensors, from whichever files hold them."""

    def __init__(self, path: str, manifest: dict):
        self.path = path
        self.tensors = manifest["tensors"]
        self._open: dict[str, _File] = {}

    def _file(self, name: str) -> _File:
        handle = self._open.get(name)
        if handle is None:
            handle = self._open[name] = _File(os.path.join(self.path, name))
        return handle

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()

    def numel(self, name: str) -> int:
        n = 1
        for d in self.tensors[name]["shape"]:
            n *= d
        return n

    def dtype(self, name: str) -> torch.dtype:
        return getattr(torch, self.tensors[name]["dtype"])

    def read_into(self, name: str, start: int, end: int, out: torch.Tensor) -> None:
        """Elements [start, end) of the flattened tensor `name` into `out` (end - start
        elements, any dtype and layout: converted as `copy_` would)."""
        direct = (out.is_contiguous() and out.device.type == "cpu"
                  and out.dtype == self.dtype(name))
        target = out.detach().view(-1) if direct \
            else torch.empty(end - start, dtype=self.dtype(name))
        covered = 0
        for file, key, lo, hi in self.tensors[name]["pieces"]:
            a, b = max(lo, start), min(hi, end)
            if a < b:
                self._file(file).read_into(key, a - lo, target[a - start:b - start])
                covered += b - a
        if covered != end - start:
            raise CheckpointError(f"{self.path}: the saved ranges of {name} do not cover elements "
                                  f"{start}..{end}; the checkpoint is incomplete")
        if not direct:
            out.copy_(target.view(out.shape))

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor `name`, in its saved dtype."""
        out = torch.empty(end - start, dtype=self.dtype(name))
        self.read_into(name, start, end, out)
        return out

    def full(self, name: str) -> torch.Tensor:
        return self.read(name, 0, self.numel(name)).view(self.tensors[name]["shape"])
