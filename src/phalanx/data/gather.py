"""`px.gather`: every rank's value, in rank order, on every rank.

Tensors travel as tensors (one all-gather), padded along the first dimension to the longest
and cut back after, so ranks may hold different numbers of rows; their other dimensions and
dtype must agree. Anything else travels pickled (`all_gather_object`). In a world of one no
process group is needed: the result is `[value]`.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .. import runtime

__all__ = ["gather", "all_gather_objects", "comm_device"]


def comm_device(group) -> torch.device:
    """The device a collective on `group` works on: this rank's GPU for NCCL, else the CPU."""
    return runtime.device() if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")


def all_gather_objects(obj, group) -> list:
    """Every rank's picklable `obj`, in rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather(value, group=None) -> list:
    """Every rank's `value`, as a list in rank order, on every rank (a collective).

        rows = px.gather(predictions)        # [rank 0's tensor, rank 1's tensor, ...]
        everything = torch.cat(rows)

    `group` defaults to the job's process group.
    """
    group = runtime.default_group() if group is None else group
    if group is None:
        return [value]
    if isinstance(value, torch.Tensor):
        return _gather_tensor(value, group)
    return all_gather_objects(value, group)


_MAX_DIMS = 16


def _describe(t: torch.Tensor, device) -> torch.Tensor:
    """dtype and shape as one small int64 tensor, so a tensor's metadata costs one all-gather."""
    dims = list(t.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(t.dim(), _MAX_DIMS))
    return torch.tensor([zlib.crc32(str(t.dtype).encode()), t.dim()] + dims, device=device)


def _gather_tensor(t: torch.Tensor, group) -> list:
    device = comm_device(group)
    meta = _describe(t, device)
    metas = [torch.empty_like(meta) for _ in range(dist.get_world_size(group))]
    dist.all_gather(metas, meta, group=group)
    metas = [m.tolist() for m in metas]
    shapes = [tuple(m[2:2 + min(m[1], _MAX_DIMS)]) for m in metas]
    # Every rank sees every shape, so every rank raises the same error: none is left waiting.
    if len({m[0] for m in metas}) > 1:
        raise ValueError(f"px.gather: ranks hold tensors of different dtypes; convert them to "
                         f"one dtype first (this rank has {t.dtype})")
    if max(m[1] for m in metas) > _MAX_DIMS:
        raise ValueError(f"px.gather: tensors of more than {_MAX_DIMS} dimensions are not "
                         f"supported; reshape first")
    if len({s[1:] for s in shapes}) > 1 or len({len(s) for s in shapes}) > 1:
        raise ValueError(f"px.gather: tensor shapes {shapes} differ beyond the first dimension; "
                         f"only the number of rows may differ between ranks")
    scalar = t.dim() == 0
    x = t.detach().reshape(1) if scalar else t.detach()
    lengths = [1 if scalar else s[0] for s in shapes]
    is_bool = x.dtype == torch.bool
    x = x.to(device, torch.uint8 if is_bool else x.dtype).contiguous()
    longest = max(lengths)
    if x.shape[0] < longest:
        x = torch.cat([x, x.new_zeros((longest - x.shape[0],) + tuple(x.shape[1:]))])
    parts = [torch.empty_like(x) for _ in lengths]
    dist.all_gather(parts, x, group=group)
    out = []
    for part, n in zip(parts, lengths):
        part = part[:n].to(t.device, torch.bool if is_bool else t.dtype)
        out.append(part.reshape(()) if scalar else part)
    return out
