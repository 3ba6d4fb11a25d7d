"""What a checkpoint of a DiLoCo model holds beyond the model and optimizer (model/diloco.py).

[Note: a DiLoCo checkpoint]
Between two syncs every rank's weights and inner optimizer state are its own, so a checkpoint
holds:
  model/<name>                          the weights of the last sync (the weights every rank
                                        shares): what `px.export`, a load into a model prepared
                                        under another strategy, or a plain module gets;
  diloco/outer/<name>/momentum_buffer   the outer SGD's momentum (written once, every rank
                                        holds the same);
  diloco/rank<r>/model/<name>           rank r's own weights at the save;
  diloco/rank<r>/optim/<name>/<key>     rank r's own inner optimizer state (Adam's moments);
  diloco/rank<r>/error/<name>           rank r's error feedback (a comm_dtype that rounds);
  diloco/outer/<name>/in_flight         streaming: the average of the fragment sent and not
                                        applied yet, for that fragment's parameters (waited
                                        for at the save; the same on every rank);
  the position in the cycle of sync_every steps (`inner_steps`: the steps since the sync under
  plain DiLoCo), in the small state.
The inner optimizer's state under `optim/` is, as under ddp, that of the rank that writes each
parameter, for loads into a model that is not DiLoCo.

A load restores the synced weights and the outer momentum on every rank. Then:
  - at the world size of the save, each rank takes back its own weights, inner optimizer
    state, error feedback, the position in the cycle and the average in flight (applied when
    it is due), so the run goes on exactly as if it had not stopped, wherever in the interval
    it was saved;
  - at another world size, the run resumes from the last sync: the average in flight is
    applied to the synced weights, every rank's weights are the synced ones, the count starts
    again at 0, rank r takes saved rank (r mod N)'s inner optimizer state (N: the world size
    of the save), and every rank the mean of the saved ranks' error feedback (what the
    average still owes them). The inner steps made since the sync are lost (a warning says
    how many); a save right after a sync loses none. Where the algorithm
    does not depend on the world size (sync_every=1 with an inner SGD without state, the
    pseudo-gradient then being the learning rate times the mean gradient) the resumed run
    equals the uninterrupted one.
"""

from __future__ import annotations

import warnings

import torch

from ..engine.optim import per_element
from .state import Range

__all__ = ["DILOCO", "outer_of", "outer_ranges", "load_outer", "param_of"]

DILOCO = "model.diloco"  # where the small state keeps the count of inner steps


def outer_of(prepared):
    """The `OuterSync` (engine/diloco.py) of a prepared DiLoCo model, else None."""
    return prepared._diloco if prepared is not None else None


def param_of(name: str) -> str:
    """The parameter a `diloco/...` tensor belongs to (parameter names have no '/')."""
    parts = name.split("/")
    return parts[3] if parts[1] != "outer" else parts[2]


@torch.no_grad()
def outer_ranges(model_state, optim_state, owner: dict, rank: int) -> list[Range]:
    """This rank's DiLoCo ranges (see the Note)."""
    outer = model_state.outer
    out = []
    in_flight = outer.pending_average()
    averages = {} if in_flight is None else dict(zip(outer.fragments[in_flight[0]],
                                                     in_flight[1]))
    for name, p in model_state.trainable.items():
        i = outer.index[id(p)]
        momentum = outer.momentum_of(i)
        if momentum is not None and model_state.writes(name, owner):
            out.append(Range(f"diloco/outer/{name}/momentum_buffer", 0, p.numel(),
                             momentum.detach().reshape(-1)))
        if i in averages and model_state.writes(name, owner):
            out.append(Range(f"diloco/outer/{name}/in_flight", 0, p.numel(),
                             averages[i].detach().reshape(-1)))
        out.append(Range(f"diloco/rank{rank}/model/{name}", 0, p.numel(),
                         outer.masters[i].detach().reshape(-1)))
        error = outer.error_of(i)
        if error is not None:
            out.append(Range(f"diloco/rank{rank}/error/{name}", 0, p.numel(),
                             error.detach().reshape(-1)))
        if optim_state is None:
            continue
        master = outer.masters[i]
        for key, value in optim_state.optimizer.state.get(master, {}).items():
            if per_element(key, value, master.shape):
                out.append(Range(f"diloco/rank{rank}/optim/{name}/{key}", 0, p.numel(),
                                 value.detach().reshape(-1)))
    return out


@torch.no_grad()
def load_outer(model_state, optim_state, reader, manifest: dict, small: dict) -> None:
    """After the model (and optimizer) were loaded: the outer state (see the Note). A
    checkpoint saved without DiLoCo starts the outer state afresh from its weights."""
    outer = model_state.outer
    rank, world = model_state.comm.rank, model_state.comm.world
    saved_world = int(manifest["world_size"])
    same = saved_world == world
    tensors = manifest["tensors"]
    own = f"diloco/rank{rank % saved_world}"
    mine, averages = [], {}
    for name, p in model_state.trainable.items():
        i = outer.index[id(p)]
        outer.synced[i].copy_(outer.masters[i])  # model/<name>: the synced weights
        key = f"diloco/outer/{name}/momentum_buffer"
        outer.set_momentum(i, reader.read(key, 0, p.numel()).view(p.shape)
                           if key in tensors else None)
        key = f"diloco/outer/{name}/in_flight"
        if key in tensors:
            averages[i] = reader.read(key, 0, p.numel()).view(p.shape).to(outer.synced[i].dtype)
        key = f"{own}/model/{name}"
        mine.append(reader.read(key, 0, p.numel()).view(p.shape) if same and key in tensors
                    else None)
        outer.set_error(i, _error(reader, tensors, name, p.numel(), rank, saved_world, same))
        if optim_state is None:
            continue
        master = outer.masters[i]
        prefix = f"{own}/optim/{name}/"
        for state_key, value in optim_state.optimizer.state.get(master, {}).items():
            if prefix + state_key in tensors and per_element(state_key, value, master.shape):
                reader.read_into(prefix + state_key, 0, p.numel(), value)
    steps = int(small.get("stateful", {}).get(DILOCO, {}).get("inner_steps", 0))
    in_flight = _in_flight(outer, averages)
    if same and all(m is not None for m in mine):
        outer.restore(mine, steps, in_flight)
        return
    outer.restore(None, 0, in_flight)
    if steps and rank == 0:
        warnings.warn(f"px.load: this DiLoCo checkpoint was saved {steps} inner step(s) after a "
                      f"sync at world size {saved_world}; at world size {world} the run resumes "
                      "from that sync and those steps are not in it (save right after a sync, "
                      "or resume at the same world size, to lose none)", stacklevel=3)


def _error(reader, tensors, name: str, numel: int, rank: int, saved_world: int, same: bool):
    """This rank's error feedback at the load: its own at the same world size, else the mean
    of the saved ranks' (see the Note); None where none was saved."""
    if same:
        key = f"diloco/rank{rank}/error/{name}"
        return reader.read(key, 0, numel) if key in tensors else None
    keys = [f"diloco/rank{r}/error/{name}" for r in range(saved_world)]
    if not all(k in tensors for k in keys):
        return None
    total = reader.read(keys[0], 0, numel).clone()
    for key in keys[1:]:
        total += reader.read(key, 0, numel)
    return total / saved_world


def _in_flight(outer, averages: dict) -> tuple | None:
    """(fragment, its averages) from the `in_flight` tensors read, or None."""
    if not averages:
        return None
    for k, members in enumerate(outer.fragments):
        if set(members) == set(averages):
            return k, [averages[i] for i in members]
    raise ValueError("px.load: this DiLoCo checkpoint holds the average of a fragment in flight "
                     "whose parameters are no fragment of this model's DiLoCo: load it with "
                     "the fragments= it was saved with (or load a checkpoint saved with no "
                     "fragment in flight, e.g. right after a fragment was applied)")
