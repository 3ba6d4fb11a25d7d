"""Parameters stepped whole on one owner rank: a matrix-wise optimizer under sharding.

[Note: whole parameters on owner ranks]
Under zero1, zero2 and zero3 each rank holds the slice [r*S, (r+1)*S) of every unit's flat
buffer (flat.py), which cuts parameters anywhere. A matrix-wise optimizer (optimizer_kinds.py)
needs some parameters whole, so each of those has one *owner* rank that steps all of it:

  gather   one all-to-all per run of units: every rank sends each owner its slice of the
           owned parameter's reduced gradient and of its master (both in the master dtype);
           the owner lays them end to end into the whole gradient and the whole master;
  step     the user's optimizer steps the owner's whole tensor (`Whole.tensor`: a Parameter
           whose storage exists only during the step) beside the flat path's pieces of the
           element-wise parameters, in the same call;
  scatter  one all-to-all back: each rank receives its slice of the updated master, writes it
           into its own master piece, and the unit is published as always (unshard, or zero3's
           next gather).

The masters stay sliced 1/N as for every optimizer (the shard is the truth: flat.py), so
checkpoints, zero3's gathers and a relayout see nothing new; the optimizer state of a whole
parameter lives on its owner only, keyed by `Whole.tensor`, and is saved and loaded as a range
[0, numel) of that parameter (optim.py's holders), so it resumes at any world size and strategy.

Owners are chosen once, from the layout alone (the same answer on every rank): largest
parameter first, each to the rank with the fewest elements owned so far, ties to the rank that
holds most of it (less to send), then the lowest rank. So each rank keeps about 1/N of the
whole parameters' state and does about 1/N of their optimizer work. What an owner holds beyond
its shard during a step is the run's owned parameters' gradient and master, whole, and the
optimizer's temporaries (Muon's Newton-Schulz iterates), freed after the step.

Per step the wire carries, for whole parameters of E elements in all, about 2E(N-1)/N elements
to the owners and E(N-1)/N back, in the master dtype; the step report counts them as
"all_to_all".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .flat import FlatUnit, Piece

__all__ = ["Whole", "WholeParams"]


@dataclass(eq=False)
class Whole:
    """One parameter stepped whole: where its elements lie, on each rank, and its owner."""
    unit: FlatUnit
    param_index: int             # in unit.params
    param: torch.nn.Parameter
    spans: list[tuple[int, int]]  # rank r's elements of the flattened parameter: [a, b)
    owner: int
    mine: list[Piece]            # this rank's master pieces of it, in order (flat.py's cap)
    tensor: torch.nn.Parameter | None = None  # on the owner: what the optimizer steps
    # the elements sent with each gradient slice: the gradient's, then the master's
    numel: int = field(init=False)

    def __post_init__(self):
        self.numel = self.param.numel()

    def span(self, rank: int) -> int:
        a, b = self.spans[rank]
        return b - a


class WholeParams:
    """The whole parameters of a sharded engine's units and their exchange (see the Note).

    units: the engine's units with gradients; rule(group, param) -> bool picks the parameters
    the optimizer needs whole; group_of maps a parameter to its param group (a dict)."""

    def __init__(self, units: list[FlatUnit], rule, group_of: dict, comm):
        self.comm = comm
        world, rank = comm.world, comm.rank
        self.wholes: list[Whole] = []
        candidates = []
        for unit in units:
            shard = unit.hi - unit.lo
            for i, (p, offset) in enumerate(zip(unit.params, unit.offsets)):
                group = group_of.get(p)
                if group is None or not rule(group, p):
                    continue
                spans = [_clamped(r * shard - offset, (r + 1) * shard - offset, p.numel())
                         for r in range(world)]
                mine = [piece for piece in unit.pieces if piece.param_index == i]
                candidates.append((unit, i, p, spans, mine))
        load = [0] * world
        owners = {}
        order = sorted(range(len(candidates)), key=lambda k: -candidates[k][2].numel())
        for k in order:
            spans = candidates[k][3]
            owner = min(range(world), key=lambda r: (load[r], -(spans[r][1] - spans[r][0]), r))
            owners[k] = owner
            load[owner] += candidates[k][2].numel()
        for k, (unit, i, p, spans, mine) in enumerate(candidates):
            w = Whole(unit, i, p, spans, owners[k], mine)
            if w.owner == rank:
                w.tensor = torch.nn.Parameter(_empty(unit))
            self.wholes.append(w)
        self._of_param = {id(w.param): w for w in self.wholes}

    def __bool__(self) -> bool:
        return bool(self.wholes)

    def of(self, param) -> Whole | None:
        return self._of_param.get(id(param))

    def owned(self) -> list[Whole]:
        """The whole parameters this rank steps."""
        return [w for w in self.wholes if w.tensor is not None]

    # -- the exchange ---------------------------------------------------------------------
    def _in(self, run: list[FlatUnit]) -> list[Whole]:
        """The whole parameters of `run` that have a gradient this step (the same on every
        rank: the reduced flags, or a gradient given by hand on every rank alike)."""
        units = {id(u) for u in run}
        return [w for w in self.wholes if id(w.unit) in units and _has_grad(w)]

    @torch.no_grad()
    def start_gather(self, run: list[FlatUnit], grad_of, comm=None) -> "_Gathering | None":
        """Put on the wire every owner's whole gradient and master for the parameters of
        `run` (`grad_of(w)`: this rank's slice of w's gradient, in the master dtype); its
        `finish()` waits and lays them into the owners' `Whole.tensor`. Nothing to do: None.
        `comm`: a group of the same ranks to issue on (default: the engine's)."""
        wholes = self._in(run)
        if not wholes:
            return None
        comm = comm or self.comm
        world, me = comm.world, comm.rank
        dtype = wholes[0].unit.master_dtype
        device = wholes[0].unit.master.device
        sends = []
        for r in range(world):
            for w in wholes:
                if w.owner == r and w.mine:
                    sends += [grad_of(w).reshape(-1)] + [piece.master.reshape(-1)
                                                         for piece in w.mine]
        input_splits = [2 * sum(w.span(me) for w in wholes if w.owner == r) for r in range(world)]
        output_splits = [2 * sum(w.span(r) for w in wholes if w.owner == me)
                         for r in range(world)]
        sent = torch.cat(sends).to(dtype) if sends else torch.empty(0, dtype=dtype, device=device)
        got = torch.empty(sum(output_splits), dtype=dtype, device=device)
        handle = comm.all_to_all(got, sent, output_splits, input_splits, async_op=True,
                                 tag="whole:gather")
        return _Gathering(handle, got, [w for w in wholes if w.owner == me], world)

    @torch.no_grad()
    def scatter(self, run: list[FlatUnit], comm=None) -> None:
        """The owners' updated masters back into every rank's master pieces; the owners'
        whole tensors are let go."""
        wholes = self._in(run)
        if not wholes:
            return
        comm = comm or self.comm
        world, me = comm.world, comm.rank
        dtype = wholes[0].unit.master_dtype
        device = wholes[0].unit.master.device
        mine = [w for w in wholes if w.owner == me]
        sends = [w.tensor.detach().reshape(-1)[w.spans[r][0]:w.spans[r][1]]
                 for r in range(world) for w in mine]
        input_splits = [sum(w.span(r) for w in mine) for r in range(world)]
        output_splits = [sum(w.span(me) for w in wholes if w.owner == r) for r in range(world)]
        sent = torch.cat(sends) if sends else torch.empty(0, dtype=dtype, device=device)
        got = torch.empty(sum(output_splits), dtype=dtype, device=device)
        comm.all_to_all(got, sent, output_splits, input_splits, tag="whole:scatter")
        for w in mine:
            w.tensor.grad = None
            w.tensor.data = _empty(w.unit)
        at = 0
        for r in range(world):
            for w in wholes:
                if w.owner == r and w.mine:
                    for piece in w.mine:
                        n = piece.end - piece.start
                        piece.master.view(-1).copy_(got[at:at + n])
                        at += n


class _Gathering:
    """An owners' gather on the wire (`WholeParams.start_gather`)."""

    def __init__(self, handle, got: torch.Tensor, mine: list[Whole], world: int):
        self.handle, self.got, self.mine, self.world = handle, got, mine, world

    @torch.no_grad()
    def finish(self) -> None:
        self.handle.wait()
        got = self.got
        grads = [torch.empty(w.numel, dtype=got.dtype, device=got.device) for w in self.mine]
        masters = [torch.empty(w.numel, dtype=got.dtype, device=got.device) for w in self.mine]
        at = 0
        for r in range(self.world):
            for w, grad, master in zip(self.mine, grads, masters):
                a, b = w.spans[r]
                grad[a:b].copy_(got[at:at + b - a])
                master[a:b].copy_(got[at + b - a:at + 2 * (b - a)])
                at += 2 * (b - a)
        for w, grad, master in zip(self.mine, grads, masters):
            w.tensor.data = master.view(w.param.shape)
            w.tensor.grad = grad.view(w.param.shape)
        self.got = None


def _has_grad(w: Whole) -> bool:
    used = w.unit.used
    if used is not None:
        return bool(used[w.param_index])
    return w.param.grad is not None  # a step without a backward: gradients given by hand


def _clamped(a: int, b: int, n: int) -> tuple[int, int]:
    """[a, b) within [0, n), empty where they do not meet."""
    a = min(max(a, 0), n)
    return a, max(min(b, n), a)


def _empty(unit: FlatUnit) -> torch.Tensor:
    """An owner's whole tensor between steps: no elements, in the master's dtype and device
    (which torch's load_state_dict casts the loaded state to)."""
    return torch.empty(0, dtype=unit.master_dtype, device=unit.master.device)
