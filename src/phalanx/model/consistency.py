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

__all__ = ["ModelMismatchError", "check_same_structure", "broadcast_from_rank0",
           "broadcast_tensors"]


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


def check_same_structure(module: torch.nn.Module, comm, options: dict | None = None) -> None:
    """Raise on every rank if any rank's parameters or buffers differ in name, shape, dtype or
    requires_grad (in order) from rank 0's, or if the options of `px.prepare` differ (a
    strategy, precision, bucket size or communication dtype that differs between ranks ends in
    wrong numbers or a native abort, not an error). One exchange of digests checks both."""
    if comm.world == 1:
        return
    mine = _structure(module)
    options = {k: repr(v) for k, v in (options or {}).items()}
    digest = hashlib.sha256(repr((mine, sorted(options.items()))).encode()).hexdigest()
    digests = comm.all_gather_object(digest, tag="prepare:structure digest")
    if len(set(digests)) == 1:
        return
    everything = comm.all_gather_object((options, mine), tag="prepare:structure")
    for r, (other_options, _) in enumerate(everything[1:], start=1):
        for name in sorted(set(options) | set(other_options)):
            a, b = everything[0][0].get(name), other_options.get(name)
            if a != b:
                raise ModelMismatchError(
                    f"px.prepare was called with {name}={a} on rank 0 but {name}={b} on rank "
                    f"{r}; every rank must pass the same options")
    reference = everything[0][1]
    for r, (_, other) in enumerate(everything[1:], start=1):
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


COALESCE_BYTES = 25 * 2**20  # a broadcast's flat buffer, at most (a tensor larger goes alone)


@torch.no_grad()
def broadcast_tensors(tensors, comm, src: int = 0, tag: str = "broadcast") -> None:
    """Broadcast tensors from `src`, coalesced into flat buffers per dtype and device of at
    most COALESCE_BYTES each (prepare's broadcast of the model no longer holds a second copy
    of every parameter at once; a run of small buffers is still one collective)."""
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for members in by_kind.values():
        run, size = [], 0
        for t in members + [None]:
            nbytes = t.numel() * t.element_size() if t is not None else 0
            if run and (t is None or size + nbytes > COALESCE_BYTES):
                _broadcast_run(run, comm, src, tag)
                run, size = [], 0
            if t is not None:
                run.append(t)
                size += nbytes


def _broadcast_run(members, comm, src: int, tag: str) -> None:
    if len(members) == 1 and members[0].is_contiguous():
        comm.broadcast(members[0], src=src, tag=tag)
        return
    flat = torch.cat([t.reshape(-1) for t in members])
    comm.broadcast(flat, src=src, tag=tag)
    offset = 0
    for t in members:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def broadcast_from_rank0(module: torch.nn.Module, comm) -> None:
    """Give every rank rank 0's parameters and buffers."""
    if comm.world == 1:
        return
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    if tensors:
        broadcast_tensors(tensors, comm, tag="prepare:broadcast")
