"""`px.gather`: every rank's value, in rank order, on every rank.

Tensors travel as tensors (one all-gather), padded along the first dimension to the longest
and cut back after, so ranks may hold different numbers of rows; their other dimensions and
dtype must agree. Anything else travels pickled (`all_gather_object`). In a world of one no
process group is needed: the result is `[value]`.

Every collective goes through a `Comm` (`phalanx.comm.collectives`): the job's default one
(`default_comm()`), or one over the group the caller names, so each gather is in that Comm's
record under its tag.
"""

from __future__ import annotations

import zlib

import torch

from ..comm.collectives import Comm
from ..world.runtime import default_comm

__all__ = ["gather", "resolve_comm"]


def resolve_comm(group=None) -> Comm:
    """The `Comm` that a data helper issues its collectives through: the job's default Comm
    for `group=None`, `group` itself when it is a Comm, else a Comm over that process group."""
    if group is None:
        return default_comm()
    if isinstance(group, Comm):
        return group
    return Comm(group)


def gather(value, group=None) -> list:
    """Every rank's `value`, as a list in rank order, on every rank (a collective).

        rows = px.gather(predictions)        # [rank 0's tensor, rank 1's tensor, ...]
        everything = torch.cat(rows)

    `group` defaults to the job's process group; a process group or a `Comm` may be given.
    """
    return gather_with(value, resolve_comm(group), tag="gather")


def gather_with(value, comm: Comm, tag: str) -> list:
    """`gather` through `comm`, its collectives recorded under `tag`."""
    if comm.group is None:
        return [value]
    if isinstance(value, torch.Tensor):
        return _gather_tensor(value, comm, tag)
    return comm.all_gather_object(value, tag=tag)


_MAX_DIMS = 16


def _describe(t: torch.Tensor, device) -> torch.Tensor:
    """dtype and shape as one small int64 tensor, so a tensor's metadata costs one all-gather."""
    dims = list(t.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(t.dim(), _MAX_DIMS))
    return torch.tensor([zlib.crc32(str(t.dtype).encode()), t.dim()] + dims, device=device)


def _gather_tensor(t: torch.Tensor, comm: Comm, tag: str) -> list:
    device = comm.device
    metas = [m.tolist() for m in comm.all_gather_list(_describe(t, device), tag=tag)]
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
    out = []
    for part, n in zip(comm.all_gather_list(x, tag=tag), lengths):
        part = part[:n].to(t.device, torch.bool if is_bool else t.dtype)
        out.append(part.reshape(()) if scalar else part)
    return out
