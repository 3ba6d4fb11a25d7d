"""Python objects as byte tensors, for the object collectives of `Comm` (collectives.py).

A pickled CUDA tensor records the GPU it lived on, and unpickling puts it back there: on every
other rank that would allocate on the sender's GPU (a CUDA context there, about 0.5 GB, for
nothing), and fail outright where each rank sees only its own GPU (per-rank
CUDA_VISIBLE_DEVICES). So a tensor on any device but the CPU travels as its CPU copy, as
`torch.save(..., map_location="cpu")` would give it; a receiver moves what it needs.
"""

from __future__ import annotations

import io
import pickle

import torch

__all__ = ["dumps", "loads", "padded"]


def _as_is(t):
    return t


class _CPUPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return _as_is, (obj.detach().cpu(),)
        return NotImplemented


def dumps(obj) -> bytes:
    buffer = io.BytesIO()
    _CPUPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(part: torch.Tensor, size: int):
    """The object in the first `size` bytes of the byte tensor `part`."""
    return pickle.loads(part[:size].cpu().numpy().tobytes())


def padded(payload: torch.Tensor, length: int) -> torch.Tensor:
    """`payload` (a byte tensor) padded with zeros to `length` bytes."""
    if payload.numel() == length:
        return payload
    out = torch.zeros(length, dtype=torch.uint8, device=payload.device)
    out[:payload.numel()] = payload
    return out
