"""A model and its optimizer as a checkpoint sees them: tensors by name, in element ranges.

[Note: what a checkpoint stores]
Every tensor is stored under its name in the original module (`model/<name>`) and every
per-element optimizer state under the parameter's name and the state's (`optim/<name>/<key>`,
for example `optim/layers.0.weight/exp_avg`), with its true shape and dtype, as one or more
ranges of its elements in row-major order. Which rank holds which range at save time is not
part of the name: a sharded rank writes the ranges of its master pieces, and a tensor that every
rank holds whole is written by one rank only, chosen so that the ranks write about the same
number of bytes. Loading reads, for every piece the loading rank holds, the elements of that
piece from whichever saved ranges cover them; so a checkpoint loads at any world size and under
any strategy and precision.

What is stored is the truth of each tensor: the fp32 (the model's own dtype) masters of the
trained parameters, and buffers and frozen parameters in the dtype the module had before
`px.prepare` cast it. Under zero3 frozen parameters are sharded too (engine/flat.py) and are
written in ranges as the masters are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.collectives import Comm
from ..engine.optim import (
    Held,
    adapter_of,
    held_groups,
    native_load_state_dict,
    per_element,
    plain,
)
from ..engine.part import Range
from ..model.prepare import prepared_or_none, uncompiled
from ..model.prepared_protocol import Prepared
from ..world.runtime import default_comm
from .common import model_key, optim_key

__all__ = ["ModelState", "OptimizerState"]


@dataclass
class _Whole:
    """All of a plain module's parameter, held as one piece: the fields of the engine's
    pieces (`held_pieces()`) that a checkpoint reads."""
    start: int
    end: int
    master: torch.Tensor


class ModelState:
    """The model (prepared or plain) as named tensors and the pieces of them this rank holds."""

    def __init__(self, model: torch.nn.Module):
        self.prepared: Prepared | None = prepared_or_none(model)
        # Names as the uncompiled module has them, so a checkpoint moves between a compiled and
        # a plain model (a compiled module's own names start with "_orig_mod.").
        self.module = uncompiled(self.prepared.module if self.prepared is not None else model)
        if self.prepared is None and any(p.numel() and not p.untyped_storage().size()
                                         for p in self.module.parameters()):
            # zero3's parameters between uses: nothing to read here (a segfault in the write)
            raise ValueError(
                "this module's parameters hold no values: it is the module inside a zero3 "
                "model (px.unwrap(model)), whose parameters exist only while their unit "
                "computes; pass the model px.prepare returned (px.save(path, model=model))")
        self.engine = self.prepared._engine if self.prepared is not None else None
        if self.engine is not None:  # [Note: a step that raised in the optimizer] (engine/)
            self.engine.vote.check_stepped()
        # the prepared model's Comm: the job's, also where the engine's is a world of one (DiLoCo)
        self.comm: Comm = self.prepared._comm if self.prepared is not None else default_comm()
        # The features beside the strategy that keep state across steps: the engine's parts,
        # then the prepared model's (DiLoCo's outer step); see [Note: a part in a checkpoint]
        # in engine/part.py. A part may have the model's tensors saved as other values than
        # the live ones (DiLoCo: the weights of the last sync).
        self.parts = self.prepared._parts() if self.prepared is not None else []
        self.saved_as: dict[int, torch.Tensor] = {}
        for part in self.parts:
            self.saved_as.update(part.model_values())
        # With shard_size the engine shards over a group; the checkpoint spans the job, and the
        # first replica group alone writes the shards, which every replica reads (hybrid.py).
        replicas = self.engine.replicas if self.engine is not None else None
        self.writes_shards = replicas is None or replicas.comm.rank == 0
        self.sharded = bool(self.engine is not None and self.engine.sharded)
        named = self.module.state_dict(keep_vars=True)
        self.names: dict[int, str] = {}      # id(tensor) -> the first name it has
        self.aliases: dict[str, str] = {}   # a later name of a shared tensor -> the first
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in named.items():
            if id(t) in self.names:
                self.aliases[name] = self.names[id(t)]
            else:
                self.names[id(t)] = name
                self.tensors[name] = t
        trainable = self.engine.params if self.engine is not None else [
            p for p in self.module.parameters() if p.requires_grad]
        self.trainable = {self.names[id(p)]: p for p in trainable if id(p) in self.names}
        # The tensors held in pieces: the trained parameters' masters, and under zero3 the
        # frozen parameters' shards (engine/flat.py); every other tensor is held whole.
        if self.engine is not None:
            by_id = self.engine.held_pieces()
            self.pieces = {name: by_id[id(t)] for name, t in self.tensors.items()
                           if id(t) in by_id}
        else:
            self.pieces = {name: [_Whole(0, p.numel(), p)]
                           for name, p in self.trainable.items()}
        self.original_dtypes = dict(self.prepared._original_dtypes) if self.prepared else {}

    # -- what is saved --------------------------------------------------------------------------
    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype the tensor had before px.prepare: its master's, for a trained parameter."""
        return self.original_dtypes.get(name, self.tensors[name].dtype)

    def shapes(self) -> dict[str, tuple[list[int], torch.dtype]]:
        return {name: (list(t.shape), self.dtype_of(name)) for name, t in self.tensors.items()}

    def writer_of(self) -> dict[str, int]:
        """The rank that writes each tensor that every rank holds whole. Buffers come from rank
        0, all of them: each rank's copy changes in its own forwards (BatchNorm's statistics),
        so a checkpoint whose running mean came from one rank and running variance from another
        would match no rank; rank 0's are what every rank holds after a synchronised step
        under `broadcast_buffers` (model/buffers.py). Parameters, equal on every rank, go
        largest first, each to the rank that has written the fewest bytes so far (the same
        answer on every rank)."""
        load = [0] * self.comm.world
        owner = {}
        whole = [n for n in self.tensors if not (self.sharded and n in self.pieces)]
        parameters = {id(p) for p in self.module.parameters()}
        for name in whole:
            if id(self.tensors[name]) not in parameters:
                owner[name] = 0
                load[0] += self.tensors[name].numel() * self.tensors[name].element_size()
        whole = [n for n in whole if n not in owner]
        for name in sorted(whole, key=lambda n: (-self.tensors[n].numel(), n)):
            rank = min(range(self.comm.world), key=lambda r: (load[r], r))
            owner[name] = rank
            load[rank] += self.tensors[name].numel() * self.tensors[name].element_size()
        return owner

    def writes(self, name: str, owner: dict[str, int]) -> bool:
        if name not in owner:  # a sharded master: its shard group's first replica writes it
            return self.writes_shards
        return owner[name] == self.comm.rank

    @torch.no_grad()
    def ranges(self, owner: dict[str, int]) -> list[Range]:
        out = []
        for name, t in self.tensors.items():
            if not self.writes(name, owner):
                continue
            saved_as = self.saved_as.get(id(t))
            if saved_as is not None:  # a part's value for it (DiLoCo: the last sync's weights)
                out.append(Range(model_key(name), 0, t.numel(), saved_as.detach().reshape(-1)))
            elif name in self.pieces:  # a frozen shard is in the compute dtype: widened
                for piece in self.pieces[name]:
                    out.append(Range(model_key(name), piece.start, piece.end,
                                     piece.master.detach().reshape(-1).to(self.dtype_of(name))))
            else:
                values = t.detach().reshape(-1)
                if values.dtype != self.dtype_of(name):
                    values = values.to(self.dtype_of(name))
                out.append(Range(model_key(name), 0, t.numel(), values))
        return out

    # -- loading --------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, reader, names: set[str]) -> None:
        """Set every tensor in `names` from `reader`: each master piece this rank holds, then
        the parameters from the masters (a collective when sharded), then the rest whole."""
        for name in names & set(self.pieces):
            for piece in self.pieces[name]:
                reader.read_into(model_key(name), piece.start, piece.end, piece.master)
        if self.engine is not None:
            self.engine.publish_masters()
        for name in names - set(self.pieces):
            t = self.tensors[name]
            reader.read_into(model_key(name), 0, t.numel(), t)


class OptimizerState:
    """The optimizer's state by parameter name and state name, for the pieces this rank holds."""

    def __init__(self, optimizer, model: ModelState):
        self.optimizer = optimizer
        self.model = model
        adapter = adapter_of(optimizer)
        groups = adapter.original if adapter is not None else [
            list(g["params"]) for g in optimizer.param_groups]
        unknown = [p for g in groups for p in g if id(p) not in model.names]
        if unknown:
            raise ValueError("the optimizer holds tensors that are not parameters of the model "
                             "given to px.save/px.load; pass the model it was built over")
        self.group_names = [[model.names[id(p)] for p in g] for g in groups]
        # What the optimizer keys its state by, with the elements of a parameter each stands
        # for (engine/optim.py's `Held`): the adapter's holders once adopted (the master
        # pieces, and an owner's whole parameter: engine/owners.py), else the parameters.
        if adapter is not None and adapter.adopted:
            holders = [(model.names[id(h.param)], h) for h in adapter.holders()
                       if id(h.param) in model.names]
        else:
            holders = [(name, Held(model.trainable[name], piece.start, piece.end, piece.master,
                                   piece.master.shape))
                       for name, pieces in model.pieces.items() if name in model.trainable
                       for piece in pieces]
        self.holders = holders
        self.held: dict[int, tuple[str, Held]] = {id(h.tensor): (name, h) for name, h in holders}

    def hyperparameters(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    @torch.no_grad()
    def ranges(self, owner: dict[str, int]) -> tuple[list[Range], dict]:
        """This rank's per-element state as ranges, and the rest of the state (step counts,
        anything not shaped like the parameter) by name, from the piece that starts at 0."""
        out, whole = [], {}
        for name, held in self.holders:
            if not self.model.writes(name, owner):
                continue
            for key, value in self.optimizer.state.get(held.tensor, {}).items():
                value = plain(value)  # torchao's quantized state: as its values
                if per_element(key, value, held.shape):
                    out.append(Range(optim_key(name, key), held.start, held.end,
                                     value.detach().reshape(-1)))
                elif held.start == 0:
                    whole.setdefault(name, {})[key] = (
                        value.detach().cpu().clone() if isinstance(value, torch.Tensor)
                        else value)
        return out, whole

    def check(self, saved: dict) -> None:
        if len(saved["group_names"]) != len(self.group_names):
            raise ValueError(f"the checkpoint's optimizer has {len(saved['group_names'])} param "
                             f"groups and this optimizer {len(self.group_names)}; build the "
                             "optimizer with the same param groups as the one that was saved")

    def load(self, reader, saved: dict, names: set[str]) -> None:
        """Give the optimizer the saved state of every piece it holds, and the saved groups'
        hyperparameters, through its own load_state_dict."""
        state, groups, position = {}, [], 0
        for g, group in enumerate(held_groups(self.optimizer)):  # the master pieces
            for m in group:
                name, held = self.held.get(id(m), (None, None))
                if name is not None and name in names:
                    entry = dict(saved["whole"].get(name, {}))
                    for key in saved["keys"].get(name, []):
                        values = reader.read(optim_key(name, key), held.start, held.end)
                        entry[key] = values.view(held.shape)
                    if entry:
                        state[position] = entry
                position += 1
            groups.append({**saved["hyperparameters"][g],
                           "params": list(range(position - len(group), position))})
        native_load_state_dict(self.optimizer)({"state": state, "param_groups": groups})
