"""The state of a flat engine as the rest of phalanx reads and writes it: masters, by
parameter and in full, and what a peer asks this rank for (remote.py).

A mixin of `FlatEngine` (flat_engine.py), which holds the units, the communicator, the lock and
the shard service these methods use.
"""

from __future__ import annotations

import torch

from .. import pickled
from .flat import FlatUnit, Piece

__all__ = ["EngineState"]


class EngineState:
    @torch.no_grad()
    def master_values(self) -> dict[int, torch.Tensor] | None:
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
    def master_pieces(self) -> dict[int, list[Piece]]:
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

    @torch.no_grad()
    def publish_masters(self) -> None:
        """Refresh the parameters from masters written in place (through `master_pieces`):
        a collective when the masters are sharded, so every rank calls it. (zero3 keeps no
        parameters between steps: the next forward gathers them from the masters.)"""
        if self.reshards:
            return
        for unit in self.units:
            unit.unshard(self.comm, async_op=False)

    @torch.no_grad()
    def load_masters(self, values: dict[int, torch.Tensor]) -> None:
        """Set the masters from full-precision values, keyed by id(param); then refresh the
        parameters from them (no collective: every rank was given the same values)."""
        for unit in self.units:
            unit.load_master([values.get(id(p)) for p in unit.params])
            if unit.flat is not None and not unit.master_is_view and not unit.reshards:
                for p, offset in zip(unit.params, unit.bucket.offsets):
                    v = values.get(id(p))
                    if v is not None:
                        unit.flat[offset:offset + p.numel()].copy_(v.reshape(-1))

    # -- a peer's shards (remote.py) ----------------------------------------------------------
    def serve(self, kind: str, arg) -> tuple[dict, list[torch.Tensor]]:
        """What a peer asked for (under the engine's lock, on the service's thread): "master",
        this rank's slice of unit `arg`'s masters; "optimizer", this rank's optimizer state
        (the adapter's per-piece parts, pickled)."""
        if kind == "master":
            unit = self.units[arg]
            unit.sync_master_from_cache()
            return {}, [unit.master.detach().to("cpu", copy=True)]
        if kind == "optimizer":
            data = pickled.dumps(self.optim._local_parts())
            return {}, [torch.frombuffer(bytearray(data), dtype=torch.uint8)]
        raise ValueError(f"unknown request {kind!r}")

    @torch.no_grad()
    def fetch_unit(self, unit: FlatUnit, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Unit `unit`'s whole flat master buffer (padded), on the CPU, in `dtype` (default the
        master dtype): this rank's slice from its master, the others' read from the peers
        without their taking part (see [Note: reading a peer's shards] in remote.py)."""
        out = torch.empty(unit.bucket.padded_numel, dtype=dtype or unit.master_dtype)
        shard = unit.hi - unit.lo
        with self.lock:
            unit.sync_master_from_cache()
            out[unit.lo:unit.hi].copy_(unit.master)
        for peer in range(self.world):
            if peer == self.rank:
                continue
            _, (values,) = self.remote.ask(peer, self.remote_id, "master", unit.index,
                                           self.version, f"its shard of unit {unit.index}")
            out[peer * shard:(peer + 1) * shard].copy_(values)
        return out

    @torch.no_grad()
    def full_master_values(self) -> dict[int, torch.Tensor]:
        """id(param) -> its whole master (the truth: fp32 under bf16), for every trainable
        parameter: this rank's own where it holds all of it, else read one unit at a time from
        the peers onto the CPU (no collective: one rank may call it alone)."""
        local = self.master_values()
        if local is not None:
            return {k: v.detach().clone() for k, v in local.items()}
        out = {}
        for unit in self.units:
            flat = self.fetch_unit(unit)
            for p, offset in zip(unit.params, unit.bucket.offsets):
                out[id(p)] = flat[offset:offset + p.numel()].view(p.shape).clone()
        return out

    def peer_optimizer_parts(self) -> list[dict]:
        """Every rank's optimizer parts (the adapter's format), this rank's own among them,
        the others read from the peers (no collective)."""
        parts = []
        for peer in range(self.world):
            if peer == self.rank:
                parts.append(self.optim._local_parts())
                continue
            _, (data,) = self.remote.ask(peer, self.remote_id, "optimizer", None,
                                         self.version, "its share of the optimizer state")
            parts.append(pickled.loads(data, data.numel()))
        return parts
