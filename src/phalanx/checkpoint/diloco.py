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
  the count of inner steps since the sync, in the small state.
The inner optimizer's state under `optim/` is, as under ddp, that of the rank that writes each
parameter, for loads into a model that is not DiLoCo.

A load restores the synced weights and the outer momentum on every rank. Then:
  - at the world size of the save, each rank takes back its own weights, inner optimizer
    state and the count of inner steps, so the run goes on exactly as if it had not stopped,
    wherever in the interval it was saved;
  - at another world size, the run resumes from the last sync: every rank's weights are the
    synced ones, the count starts again at 0, and rank r takes saved rank (r mod N)'s inner
    optimizer state (N: the world size of the save). The inner steps made since the sync are
    lost (a warning says how many); a save right after a sync loses none. Where the algorithm
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
    return getattr(prepared, "_diloco", None) if prepared is not None else None


def param_of(name: str) -> str:
    """The parameter a `diloco/...` tensor belongs to (parameter names have no '/')."""
    parts = name.split("/")
    return parts[3] if parts[1] != "outer" else parts[2]


def synced_values(model_state) -> dict:
    """Parameter name -> the weights of the last sync (saved as `model/<name>`)."""
    outer = model_state.outer
    return {name: outer.synced[outer.index[id(p)]] for name, p in model_state.trainable.items()}


@torch.no_grad()
def outer_ranges(model_state, optim_state, owner: dict, rank: int) -> list[Range]:
    """This rank's DiLoCo ranges (see the Note)."""
    outer = model_state.outer
    out = []
    for name, p in model_state.trainable.items():
        i = outer.index[id(p)]
        momentum = outer.momentum_of(i)
        if momentum is not None and model_state.writes(name, owner):
            out.append(Range(f"diloco/outer/{name}/momentum_buffer", 0, p.numel(),
                             momentum.detach().reshape(-1)))
        out.append(Range(f"diloco/rank{rank}/model/{name}", 0, p.numel(),
                         outer.masters[i].detach().reshape(-1)))
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
    mine = []
    for name, p in model_state.trainable.items():
        i = outer.index[id(p)]
        outer.synced[i].copy_(outer.masters[i])  # model/<name>: the synced weights
        key = f"diloco/outer/{name}/momentum_buffer"
        outer.set_momentum(i, reader.read(key, 0, p.numel()).view(p.shape)
                           if key in tensors else None)
        key = f"{own}/model/{name}"
        mine.append(reader.read(key, 0, p.numel()).view(p.shape) if same and key in tensors
                    else None)
        if optim_state is None:
            continue
        master = outer.masters[i]
        prefix = f"{own}/optim/{name}/"
        for state_key, value in optim_state.optimizer.state.get(master, {}).items():
            if prefix + state_key in tensors and per_element(state_key, value, master.shape):
                reader.read_into(prefix + state_key, 0, p.numel(), value)
    steps = int(small.get("stateful", {}).get(DILOCO, {}).get("inner_steps", 0))
    if same and all(m is not None for m in mine):
        outer.restore(mine, steps)
        return
    outer.restore(None, 0)
    if steps and rank == 0:
        warnings.warn(f"px.load: this DiLoCo checkpoint was saved {steps} inner step(s) after a "
                      f"sync at world size {saved_world}; at world size {world} the run resumes "
                      "from that sync and those steps are not in it (save right after a sync, "
                      "or resume at the same world size, to lose none)", stacklevel=3)
