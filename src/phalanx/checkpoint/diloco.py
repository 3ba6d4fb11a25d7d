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
  plain DiLoCo) and the schedule (sync_every, fragments, delay, keep_local), in the small
  state.
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
    average still owes them). The inner steps made since the sync are lost, and a warning
    says so: under plain DiLoCo how many (a save right after a sync loses none); under
    streaming (fragments, a delay or keep_local) each rank's weights always hold steps made
    since some fragment's sync. Where the algorithm does not depend on the world size
    (sync_every=1 with an inner SGD without state, the pseudo-gradient then being the
    learning rate times the mean gradient) the resumed run equals the uninterrupted one.
A load into a model that is not DiLoCo (prepared under another strategy) takes the synced
weights under model/ and the inner optimizer state under optim/, and nothing else: rank 0
warns, naming what is left out (the inner steps since the sync, the outer momentum, an
average in flight, the error feedback) and that a model prepared with the px.DiLoCo of the
save keeps it. A plain module loaded without an optimizer (an evaluation; what px.export
writes) takes the synced weights without a warning.
"""

from __future__ import annotations

import warnings

import torch

from ..engine.optim import per_element
from .state import Range

__all__ = ["DILOCO", "outer_of", "outer_ranges", "outer_small_state", "load_outer",
           "warn_left_out", "param_of"]

DILOCO = "model.diloco"  # where the small state keeps the count of inner steps, the schedule


def outer_small_state(outer) -> dict:
    """What the small state keeps of the outer state (see the Note): the position in the cycle,
    and the schedule, which says what a resume from the synced weights loses."""
    config = outer.config
    return {"inner_steps": outer.inner_steps, "sync_every": config.sync_every,
            "fragments": config.fragments, "delay": config.delay,
            "keep_local": float(config.keep_local)}


def _streaming(saved: dict) -> bool:
    """Whether the checkpoint's DiLoCo streams (fragments, a delay or keep_local): then each
    rank's weights always hold inner steps made since some fragment's sync, where plain
    DiLoCo's are the synced ones right after each sync. (A checkpoint of an older phalanx
    records no schedule: plain.)"""
    return saved.get("fragments", 1) != 1 or bool(saved.get("delay")) or \
        bool(saved.get("keep_local"))


def _steps_lost(saved: dict) -> str | None:
    """The inner steps a resume from the synced weights loses, in words; None: none."""
    steps = int(saved.get("inner_steps", 0))
    if _streaming(saved):
        return (f"the inner steps each rank made since each fragment's last sync (the save "
                f"was {steps} steps into a cycle of {saved.get('sync_every')})")
    return f"the {steps} inner step(s) each rank made since the last sync" if steps else None


def warn_left_out(model_state, optim_state, manifest: dict, small: dict) -> None:
    """After a DiLoCo checkpoint was loaded into a model that is not DiLoCo: on rank 0, a
    warning naming what the load left out, if anything (see the Note)."""
    saved = small.get("stateful", {}).get(DILOCO)
    if saved is None or model_state.comm.rank != 0 or \
            (model_state.prepared is None and optim_state is None):
        return
    tensors = manifest["tensors"]
    lost = _steps_lost(saved)
    left = [lost] if lost is not None else []
    for suffix, what in (("/momentum_buffer", "the outer momentum"),
                         ("/in_flight", "a fragment's average in flight (sent, not applied)")):
        if any(k.startswith("diloco/outer/") and k.endswith(suffix) for k in tensors):
            left.append(what)
    if any(k.startswith("diloco/rank") and "/error/" in k for k in tensors):
        left.append("each rank's error feedback")
    if not left:
        return
    what = left[-1] if len(left) == 1 else ", ".join(left[:-1]) + " and " + left[-1]
    warnings.warn(f"px.load: this checkpoint was saved under px.DiLoCo (world size "
                  f"{manifest['world_size']}) and the model it is loaded into is not DiLoCo: it "
                  f"takes the weights of the last sync and leaves out {what}. To go on from "
                  "where the run stopped, load it into a model prepared with the px.DiLoCo it "
                  "was saved with, at the same world size", stacklevel=4)


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
    saved = small.get("stateful", {}).get(DILOCO, {})
    steps = int(saved.get("inner_steps", 0))
    in_flight = _in_flight(outer, averages)
    if same and all(m is not None for m in mine):
        outer.restore(mine, steps, in_flight)
        return
    outer.restore(None, 0, in_flight)
    if rank != 0:
        return
    if _streaming(saved):
        warnings.warn(f"px.load: this DiLoCo checkpoint was saved {steps} steps into a cycle "
                      f"of {saved.get('sync_every')} at world size {saved_world} (streaming); "
                      f"at world size {world} the run resumes from each fragment's last sync, "
                      "and the inner steps each rank made since are not in it (resume at the "
                      "same world size to lose none)", stacklevel=3)
    elif steps:
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
