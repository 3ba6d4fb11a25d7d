"""One walker over nested outputs: tensors inside tuples, lists, dicts and dataclass-like objects
(model outputs such as Hugging Face's `ModelOutput`, namedtuples)."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["map_tensors", "to_device"]


def map_tensors(fn, obj):
    """Apply `fn` to every tensor in a nest of tuples, lists, dicts and dataclass-like outputs,
    rebuilding each container with its own type."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, dict):
        mapped = {k: map_tensors(fn, v) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        try:
            return type(obj)(**mapped)  # output classes built from their fields
        except TypeError:
            out = type(obj)()
            out.update(mapped)
            return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(fn, getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def to_device(inputs, device: torch.device):
    """`inputs` with every tensor in it on `device` (copied without blocking the host; those
    already there are left as they are)."""
    return map_tensors(lambda t: t if t.device == device else t.to(device, non_blocking=True),
                       inputs)
