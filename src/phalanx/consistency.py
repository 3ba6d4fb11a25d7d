"""Make every rank start from the same model, or say precisely why it cannot.

Data parallelism is only correct when every rank holds the same architecture. A model that
differs (another config on one node, a layer added under `if rank == 0`) would otherwise show up
as a hang in the first collective or as silently wrong training, so `px.prepare` compares the
structure first, on every rank, and names the first difference. Then rank 0's values are
broadcast, so differently seeded initialisations do not matter.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from . import collectives as C

__all__ = ["ModelMismatchError", "check_same_structure", "broadcast_from_rank0",
           "broadcast_tensors", "optimizer_groups"]


class ModelMismatchError(ValueError):
    """The model differs between ranks."""


def _structure(module: torch.nn.Module) -> list[tuple]:
    entries = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
               for n, p in module.named_parameters()]
    entries += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return entries


def _describe(entry) -> str:
    if entry is None:
        return "nothing"
    kind, name, shape, dtype = entry[:4]
    extra = "" if kind == "buffer" or entry[4] else ", frozen"
    return f"{kind} {name!r} of shape {list(shape)}, {dtype.replace('torch.', '')}{extra}"


def check_same_structure(module: torch.nn.Module, group) -> None:
    """Raise ModelMismatchError on every rank if any rank's parameters or buffers differ in
    name, shape, dtype or requires_grad (in order) from rank 0's."""
    if group is None:
        return
    mine = _structure(module)
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    structures = [None] * len(digests)
    dist.all_gather_object(structures, mine, group=group)
    reference = structures[0]
    for r, other in enumerate(structures[1:], start=1):
        if other == reference:
            continue
        for i in range(max(len(reference), len(other))):
            a = reference[i] if i < len(reference) else None
            b = other[i] if i < len(other) else None
            if a != b:
                raise ModelMismatchError(
                    f"the model differs between ranks: at position {i} rank 0 has "
                    f"{_describe(a)} but rank {r} has {_describe(b)}. Build the same model on "
                    "every rank (same code and config) before px.prepare")


@torch.no_grad()
def broadcast_tensors(tensors, group, src: int = 0) -> None:
    """Broadcast tensors from `src`, coalesced into one flat buffer per dtype and device."""
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for members in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in members])
        C.broadcast(flat, src=src, group=group)
        offset = 0
        for t in members:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_from_rank0(module: torch.nn.Module, group) -> None:
    """Give every rank rank 0's parameters and buffers."""
    if group is None:
        return
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    if tensors:
        broadcast_tensors(tensors, group)


def optimizer_groups(optimizer, module) -> dict:
    """Map each trainable parameter the optimizer holds to its param group index, refusing
    parameters that are not the model's: an optimizer built over another model's parameters,
    or a copy's, would step tensors that data parallelism never averages. Frozen parameters
    of the model may be in the optimizer (it skips them, having no gradient)."""
    model_params = {id(p) for p in module.parameters()}
    group_of = {}
    for g, param_group in enumerate(optimizer.param_groups):
        for p in param_group["params"]:
            if id(p) not in model_params:
                raise ValueError(
                    "the optimizer holds a parameter that is not a parameter of the model; "
                    "build the optimizer over model.parameters() of the model you prepare")
            if p.requires_grad:
                group_of[p] = g
    return group_of
