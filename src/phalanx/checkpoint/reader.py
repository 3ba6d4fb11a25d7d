"""Reading a checkpoint: its manifest, the integrity of its files, and any range of a tensor."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from .files import file_digest

__all__ = ["MANIFEST", "FORMAT", "CheckpointError", "read_manifest", "verify_files", "Reader",
           "complete_checkpoints"]

MANIFEST = "manifest.json"
FORMAT = "phalanx-checkpoint"


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded: missing, incomplete, altered, or of another model."""


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


class Reader:
    """Elements of saved tensors, from whichever files hold them."""

    def __init__(self, path: str, manifest: dict):
        self.path = path
        self.tensors = manifest["tensors"]
        self._open: dict[str, object] = {}

    def _file(self, name: str):
        handle = self._open.get(name)
        if handle is None:
            handle = self._open[name] = safe_open(os.path.join(self.path, name), framework="pt")
        return handle

    def numel(self, name: str) -> int:
        n = 1
        for d in self.tensors[name]["shape"]:
            n *= d
        return n

    def read(self, name: str, start: int, end: int, own: bool = True) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor `name`, in its saved dtype.

        With `own=False` the result may share memory with the file's mapping (the caller
        copies it somewhere at once); otherwise it is memory of its own."""
        info = self.tensors[name]
        for file, key, lo, hi in info["pieces"]:
            if (lo, hi) == (start, end):  # saved as asked (the same layout): one copy at most
                part = self._file(file).get_slice(key)[:]
                return part.clone() if own else part
        out = None
        covered = 0
        for file, key, lo, hi in info["pieces"]:
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            part = self._file(file).get_slice(key)[a - lo:b - lo]
            if out is None:
                out = torch.empty(end - start, dtype=part.dtype)
            out[a - start:b - start] = part
            covered += b - a
        if covered != end - start:
            if end == start:
                return torch.empty(0, dtype=getattr(torch, info["dtype"]))
            raise CheckpointError(f"{self.path}: the saved ranges of {name} do not cover elements "
                                  f"{start}..{end}; the checkpoint is incomplete")
        return out

    def full(self, name: str) -> torch.Tensor:
        return self.read(name, 0, self.numel(name)).view(self.tensors[name]["shape"])
