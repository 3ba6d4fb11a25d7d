"""Files of a checkpoint: safetensors written as a stream, with their size and checksum; fsync.

A rank's tensors are written in the safetensors layout (an 8-byte little-endian header length,
a JSON header naming each tensor's dtype, shape and byte range, then the bytes; see
https://github.com/huggingface/safetensors#format) and read back with the safetensors library.
The writing is done here rather than by `safetensors.torch.save_file` for two reasons: the
tensors a rank writes are views into one flat master buffer, which `save_file` refuses as
shared storage (it would need a copy of each), and `save_file` first turns every tensor into a
bytes object, a second copy of the whole file in memory. Streaming each tensor's own bytes keeps
what saving adds to memory at zero, and the checksum is taken on the way out.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import torch

__all__ = ["write_tensors", "fsync_dir", "file_digest", "DTYPE_NAMES"]

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> dict:
    """Write `tensors` (CPU or not, any layout) to `path` as safetensors, fsync it, and return
    {"bytes": size, "sha256": hex digest}."""
    header, offset, order = {}, 0, []
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"cannot save {name!r}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        order.append((name, t))
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            digest.update(chunk)
        for _, t in order:
            data = _bytes_of(t)
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy where it is already contiguous
    on the CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
