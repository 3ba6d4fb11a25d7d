"""The masters of a flat engine as the rest of phalanx reads and writes them: by parameter and
in full, the parameters refreshed from them, and what a peer asks this rank for (remote.py).

`Masters` is a part of `FlatEngine` (flat_engine.py), which hands its protocol's methods on the
masters (`master_values`, `load_masters`, ...) to it. It holds the lock a step takes while it
changes the masters, and the versions the steps count, which the shard service reads with every
request (see [Note: reading a peer's shards] in remote.py): the service is given this part, and
serves what it holds.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from ..comm.gate import continuing, lost, step_lost
from .flat import FlatUnit, Piece
from .policy import ShardPolicy
from .remote import PeerError

__all__ = ["Masters"]


class Masters:
    """The masters of `units` (and zero3's frozen shards of `frozen_units`), laid out by the
    engine under `policy` over `comm`.

    remote: the shard service other ranks read from (remote.py), or None; this part registers
        itself there, under `remote_id`.
    gatherer: zero3's UnitGatherer, or None: whether a read of the peers is a forward's.
    optimizer_parts: fn() -> this rank's optimizer state in the adapter's per-piece format
        (optim.py's `local_parts`), for a peer that asks for it.
    """

    def __init__(self, units: list[FlatUnit], frozen_units: list[FlatUnit], params: list,
                 comm, policy: ShardPolicy, *, remote, gatherer,
                 optimizer_parts: Callable[[], dict]):
        self.units = units
        self.all_units = units + frozen_units
        self.params = params
        self.comm = comm
        self.world, self.rank = comm.world, comm.rank
        self.sharded = policy.shards_optimizer(self.world)
        self.reshards = policy.reshards(self.world)
        self.gatherer = gatherer
        self._optimizer_parts = optimizer_parts
        # See [Note: reading a peer's shards] in remote.py: where this rank holds 1/N of the
        # masters, a thread serves them (and the optimizer state) to a peer that asks, and
        # `lock` keeps a step from changing them while they are read.
        self.lock = threading.Lock()
        self.version = 0  # optimizer.step() calls, counted under `lock`
        self.masters_version = 0  # ... those of them that moved the masters (stepping.py)
        self.remote = remote
        self.remote_id = remote.register(self) if remote is not None else None

    def stepped(self, moved: bool) -> None:
        """An `optimizer.step()` is over (under `lock`): one more version of the optimizer
        state, and of the masters where it moved them."""
        self.version += 1
        self.masters_version += moved

    @torch.no_grad()
    def values(self) -> dict[int, torch.Tensor] | None:
        """id(param) -> its full master value, where this rank holds all of it without a
        collective (not sharded); None when the masters are sharded."""
        if self.sharded:
            return None
        for unit in self.units:
            unit.sync_master_from_cache()
        out = {}
        for unit in self.units:
            for piece in unit.pieces:
                p = unit.params[piece.param_index]
                out[id(p)] = piece.master.detach().view_as(p)
        return out

    @torch.no_grad()
    def pieces(self) -> dict[int, list[Piece]]:
        """id(param) -> the pieces of its master that this rank holds, for every trainable
        parameter: the owned slices when sharded, the whole parameter otherwise (a parameter
        that is its own master is its own piece). Edits made behind phalanx's back are taken
        into the masters first, so the pieces hold the truth."""
        out: dict[int, list[Piece]] = {}
        for unit in self.units:
            unit.sync_master_from_cache()
            for piece in unit.pieces:
                out.setdefault(id(unit.params[piece.param_index]), []).append(piece)
        for p in self.params:  # a world of one with nothing to adopt has no units
            out.setdefault(id(p), [] if self.sharded else [Piece.whole(p)])
        return out

    def held_pieces(self) -> dict[int, list[Piece]]:
        """`pieces()`, and under zero3 also the pieces of every frozen parameter's
        shard this rank holds (in the compute dtype: [Note: frozen parameters in a unit] in
        flat.py): every parameter held in pieces, for what reads or writes them all (a
        checkpoint, a meta build's values, pretrained weights)."""
        out = self.pieces()
        for unit in self.all_units:
            for p in unit.frozen:  # none of its elements may be this rank's
                out.setdefault(id(p), [])
            for piece in unit.frozen_pieces:
                out[id(unit.members[piece.param_index])].append(piece)
        return out

    @torch.no_grad()
    def publish(self) -> None:
        """Refresh the parameters from masters written in place (through `pieces`):
        a collective when the masters are sharded, so every rank calls it. (zero3 keeps no
        parameters between steps: the next forward gathers them from the masters, or under
        offload from `kept`, refreshed here.)"""
        if self.reshards:
            for unit in self.units:
                unit.refresh_kept()
            return
        for unit in self.units:
            unit.unshard(self.comm, async_op=False)

    @torch.no_grad()
    def load(self, values: dict[int, torch.Tensor]) -> None:
        """Set the masters (and zero3's frozen shards) from full-precision values, keyed by
        id(param); then refresh the parameters from them (no collective: every rank was given
        the same values)."""
        for unit in self.all_units:
            unit.load_master([values.get(id(p)) for p in unit.members])
            if unit.flat is not None and not unit.master_is_view and not unit.reshards:
                for p, offset in zip(unit.params, unit.offsets):
                    v = values.get(id(p))
                    if v is not None:
                        unit.flat[offset:offset + p.numel()].copy_(v.reshape(-1))

    @torch.no_grad()
    def open_params(self) -> list[FlatUnit]:
        """zero3: give every freed unit's parameters their storage back, unfilled, so that a
        load through the user's module can write them; returns the units opened, for
        `close_params`. No collective: the loaded values are every rank's alike, and
        `load` takes each rank's slices of them. Nothing under the other strategies."""
        return [unit for unit in self.all_units if unit.allocate()]

    def close_params(self, opened: list[FlatUnit]) -> None:
        """Free again what `open_params` gave storage (the next forward gathers the masters)."""
        for unit in opened:
            unit.reshard()

    # -- a peer's shards (remote.py) ----------------------------------------------------------
    def serve(self, kind: str, arg) -> tuple[dict, list[torch.Tensor]]:
        """What a peer asked for (under `lock`, on the service's thread): "master",
        this rank's slice of unit `arg`'s masters; "optimizer", this rank's optimizer state
        (the adapter's per-piece parts: their skeleton in the header, their tensors joined)."""
        if kind == "master":
            unit = self.all_units[arg]
            unit.sync_master_from_cache()
            return {}, [t.detach().to("cpu", copy=True) for t in unit.held()]
        if kind == "optimizer":
            skeleton, tensors = _pack(self._optimizer_parts())
            return {"skeleton": skeleton}, tensors
        raise ValueError(f"unknown request {kind!r}")

    @torch.no_grad()
    def fetch_unit(self, unit: FlatUnit, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Unit `unit`'s whole flat buffer of masters (padded; under zero3 its frozen segment
        too), on the CPU, in `dtype` (default the master dtype): this rank's slices from its
        own, the others' read from the peers without their taking part (see [Note: reading a
        peer's shards] in remote.py).

        Under `phalanx run --on-failure continue`, in a forward (zero3's `fetch`: a forward
        without gradients), a peer lost meanwhile is a loss of the step (comm/gate.py), as
        a collective's failure is: the peers' part of the buffer is then zeros, and so is
        every later read of the step, which asks nobody. What the forward computes is thrown
        away (an evaluation's gather of it returns nothing: [Note: an evaluation redone] in
        continuing/gathers.py). Elsewhere (a state_dict) the lost peer raises `PeerError`."""
        forward = continuing() and self.gatherer is not None and self.gatherer.in_forward
        out = (torch.zeros if forward else torch.empty)(unit.numel,
                                                        dtype=dtype or unit.master_dtype)
        segments = [(0, unit.hi - unit.lo)] if unit.params else []
        if unit.frozen:
            segments.append((unit.frozen_at, unit.fhi - unit.flo))
        with self.lock:
            unit.sync_master_from_cache()
            for (at, shard), held in zip(segments, unit.held()):
                out[at + self.rank * shard:at + (self.rank + 1) * shard].copy_(held)
        if forward and step_lost():
            return out
        peers = [peer for peer in range(self.world) if peer != self.rank]
        try:
            answers = self.remote.ask(peers, self.remote_id, "master", unit.index,
                                      self.masters_version,
                                      f"its shard of unit {unit.index}")
        except PeerError as exc:
            if not (forward and exc.gone):
                raise
            lost(exc)
            return out
        for peer, (_, held) in zip(peers, answers):
            for (at, shard), values in zip(segments, held):
                out[at + peer * shard:at + (peer + 1) * shard].copy_(values)
        return out

    @torch.no_grad()
    def full_values(self) -> dict[int, torch.Tensor]:
        """id(param) -> its whole master (the truth: fp32 under bf16), for every trainable
        parameter, and under zero3 every frozen one's whole value: this rank's own where it
        holds all of it, else read one unit at a time from the peers onto the CPU (no
        collective: one rank may call it alone)."""
        local = self.values()
        if local is not None:
            return {k: v.detach().clone() for k, v in local.items()}
        out = {}
        for unit in self.all_units:
            flat = self.fetch_unit(unit)
            for p, offset in zip(unit.members, unit.offsets):
                out[id(p)] = flat[offset:offset + p.numel()].view(p.shape).clone()
        return out

    def peer_optimizer_parts(self) -> list[dict]:
        """Every rank's optimizer parts (the adapter's format), this rank's own among them,
        the others read from the peers (no collective)."""
        peers = [peer for peer in range(self.world) if peer != self.rank]
        answers = iter(self.remote.ask(peers, self.remote_id, "optimizer", None, self.version,
                                       "its share of the optimizer state"))
        parts = []
        for peer in range(self.world):
            if peer == self.rank:
                parts.append(self._optimizer_parts())
            else:
                header, tensors = next(answers)
                parts.append(_unpack(header["skeleton"], tensors))
        return parts


# -- a share of the optimizer state on the wire: tensors joined by dtype, not pickled ---------
class _Slot(tuple):
    """Where a tensor went: (index of its dtype's buffer, offset, shape)."""


def _pack(parts: dict):
    """`parts` (the adapter's format) as a skeleton without tensors and one flat CPU buffer per
    dtype: pickling hundreds of MB through a byte tensor cost 3x the time of sending them."""
    buffers: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}

    def slot(value):
        if not isinstance(value, torch.Tensor):
            return value
        flat = value.detach().reshape(-1)
        order = list(buffers).index(flat.dtype) if flat.dtype in buffers else len(buffers)
        buffers.setdefault(flat.dtype, []).append(flat)
        offset = sizes.get(flat.dtype, 0)
        sizes[flat.dtype] = offset + flat.numel()
        return _Slot((order, offset, tuple(value.shape)))

    skeleton = {index: [(start, end, {key: (kind, slot(value))
                                      for key, (kind, value) in entry.items()})
                        for start, end, entry in pieces]
                for index, pieces in parts.items()}
    return skeleton, [torch.cat(b).cpu() if len(b) > 1 else b[0].cpu().clone()
                      for b in buffers.values()]


def _unpack(skeleton: dict, tensors: list[torch.Tensor]) -> dict:
    def value(v):
        if not isinstance(v, _Slot):
            return v
        order, offset, shape = v
        numel = 1
        for n in shape:
            numel *= n
        return tensors[order][offset:offset + numel].view(shape)

    return {index: [(start, end, {key: (kind, value(v)) for key, (kind, v) in entry.items()})
                    for start, end, entry in pieces]
            for index, pieces in skeleton.items()}
