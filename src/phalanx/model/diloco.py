"""`px.DiLoCo`: the strategy that communicates once every H optimizer steps, and how
`px.prepare` builds it.

    model, optimizer = px.prepare(
        model, optimizer, strategy=px.DiLoCo(sync_every=50, outer_lr=0.7, outer_momentum=0.9))

The user's optimizer is the inner one and steps each rank's replica on its own gradients; after
every `sync_every`-th `optimizer.step()` the ranks average the pseudo-gradient and an outer
Nesterov SGD steps the weights they share (engine/diloco.py has the algorithm). The inner steps
reuse the whole prepared-model machinery: the engine is the ddp engine over a world of one (a
`Comm` without a process group, whose collectives are no-ops), so precision, no_sync,
clipping, the non-finite check and step counting behave as on one process, per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm.collectives import Comm
from ..engine.diloco import OuterSync
from .precision import COMM_DTYPES

__all__ = ["DiLoCo", "split_strategy", "check_diloco_optimizer", "inner_comm", "attach"]


@dataclass(frozen=True)
class DiLoCo:
    """DiLoCo (Douillard et al. 2023, arXiv:2311.08105) as `px.prepare(strategy=...)`.

    sync_every: H, the optimizer steps between two syncs (1 or more).
    outer_lr, outer_momentum, nesterov: the outer SGD that steps the shared weights with the
        averaged pseudo-gradient (the paper's 0.7, 0.9, Nesterov by default); with
        outer_momentum 0 there is no momentum and `nesterov` is not used.
    comm_dtype: the dtype the pseudo-gradient is averaged in: None (the masters'), torch.bfloat16
        or torch.float16 ('bf16', 'fp16': half the bytes of fp32; the paper's successors
        average it in fp16 or less, OpenDiLoCo arXiv:2407.07852), or 'int8' / 'int4'
        (torch.int8, torch.int4): whole numbers with one scale per 128 elements of each
        parameter, a quarter or an eighth of fp32's bytes plus the scales', all-gathered and
        summed in rank order on every rank (all get the same average).
    error_feedback: with a comm_dtype that rounds (all but the masters' own), keep on each
        rank what the rounding left out and add it to the next pseudo-gradient it sends (one
        buffer of the trainable parameters' size, in the masters' dtype, on every rank).

    Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512):
    fragments: P, the number of parts the trainable parameters are cut into (in the model's
        order, about equal in size). The fragments are synced in turn, one every
        sync_every / P steps, so each is synced once every sync_every steps and each sync
        sends 1/P of the model (sync_every must be a multiple of P).
    delay: the inner steps a fragment's average has to arrive: it is sent after a step and
        applied after the `delay`-th step that follows, training going on meanwhile (0: waited
        for at once). At most sync_every / P - 1, so that one fragment is in flight at a time.
    keep_local: when a fragment's outer step is applied, this rank's weights of the fragment
        become synced + keep_local * (weights - synced): 0 (the default) takes the synced
        weights, dropping the `delay` inner steps made on the fragment meanwhile; torchft
        calls it `fragment_update_alpha`.

    Between syncs nothing is communicated: the model's parameters are this rank's own, `.grad`
    is this rank's own gradient, so `px.clip_grad_norm_` clips by this rank's norm, and the
    non-finite check looks at this rank's loss only.

    A checkpoint (`px.save`) holds the weights of the last sync as the model's (what
    `px.export`, or a load into a model prepared another way, gets), the outer momentum, and
    each rank's own weights and inner optimizer state. Loaded at the world size of the save,
    the run goes on exactly as if it had not stopped, wherever in the interval it was saved.
    Loaded at another world size, it resumes from the last sync: every rank starts from the
    synced weights, rank r takes the inner optimizer state of saved rank r mod N (N: the world
    size of the save), and the inner steps made since the sync are lost, with a warning that
    says how many (a save right after a sync loses none; under streaming some fragment always
    holds steps made since its sync, and the warning says so). Under streaming a fragment's
    average that was sent but not applied yet is saved too: at the same world size it is
    applied when it is due, at another one at the load; each rank's error feedback is saved,
    and at another world size every rank takes the mean of the saved ranks'. Loaded into a
    model prepared under another strategy (ddp), it gives the synced weights, and rank 0
    warns, naming what that leaves out (the inner steps since the sync, the outer momentum,
    an average in flight, the error feedback).
    """
    # The checkpoint's layout: [Note: a DiLoCo checkpoint] in engine/diloco.py.

    sync_every: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    comm_dtype: torch.dtype | str | None = None
    error_feedback: bool = True
    fragments: int = 1
    delay: int = 0
    keep_local: float = 0.0

    def __post_init__(self):
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) \
                or self.sync_every < 1:
            raise ValueError(f"DiLoCo(sync_every={self.sync_every!r}): the number of optimizer "
                             "steps between two syncs, a whole number of 1 or more (the paper "
                             "uses 500; 1 syncs after every step)")
        for name in ("outer_lr", "outer_momentum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"DiLoCo({name}={value!r}): a finite number of 0 or more "
                                 "(defaults: outer_lr=0.7, outer_momentum=0.9)")
        if self.outer_momentum >= 1:
            raise ValueError(f"DiLoCo(outer_momentum={self.outer_momentum!r}): below 1 "
                             "(the default is 0.9)")
        for name in ("nesterov", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DiLoCo({name}={getattr(self, name)!r}): True or False")
        try:
            wire = _WIRE_DTYPES[self.comm_dtype]
        except (KeyError, TypeError):
            raise ValueError(f"DiLoCo(comm_dtype={self.comm_dtype!r}): None, torch.bfloat16, "
                             "torch.float16, torch.float32, torch.int8 or torch.int4 (or "
                             "'bf16', 'fp16', 'fp32', 'int8', 'int4')") from None
        object.__setattr__(self, "comm_dtype", wire)
        self._check_streaming()

    def _check_streaming(self) -> None:
        P, H = self.fragments, self.sync_every
        if not _whole(P) or P < 1:
            raise ValueError(f"DiLoCo(fragments={P!r}): the number of parts synced in turn, a "
                             "whole number of 1 or more (1: the whole model at each sync)")
        if H % P:
            raise ValueError(f"DiLoCo(sync_every={H}, fragments={P}): each fragment is synced "
                             f"once every sync_every steps, one every sync_every / fragments "
                             f"steps, so sync_every must be a multiple of fragments (e.g. "
                             f"sync_every={-(-H // P) * P})")
        if not _whole(self.delay) or self.delay < 0:
            raise ValueError(f"DiLoCo(delay={self.delay!r}): the inner steps an average has to "
                             "arrive, a whole number of 0 or more")
        if self.delay >= H // P:
            raise ValueError(f"DiLoCo(delay={self.delay}, sync_every={H}, fragments={P}): a "
                             "fragment's average must be applied before the next fragment is "
                             f"sent, {H // P} steps later (one in flight at a time), so delay "
                             f"must be below sync_every / fragments = {H // P}: lower delay or "
                             "fragments, or raise sync_every")
        k = self.keep_local
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 <= k <= 1:
            raise ValueError(f"DiLoCo(keep_local={k!r}): a number from 0 (take the synced "
                             "weights) to 1 (keep this rank's)")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# what the pseudo-gradient may be averaged in: the float dtypes of px.prepare's comm_dtype,
# and the quantized ones of engine/diloco_wire.py
_WIRE_DTYPES = {**COMM_DTYPES, "int8": torch.int8, "int4": torch.int4, torch.int8: torch.int8,
                torch.int4: torch.int4}


def split_strategy(strategy):
    """(the DiLoCo, "ddp": the engine its inner steps run on) for a DiLoCo strategy, else
    (None, strategy) unchanged."""
    if isinstance(strategy, DiLoCo):
        return strategy, "ddp"
    if strategy is DiLoCo:
        raise ValueError("strategy=px.DiLoCo is the class: give an instance, "
                         "strategy=px.DiLoCo(sync_every=H)")
    if isinstance(strategy, str) and strategy.lower() == "diloco":
        raise ValueError("strategy='diloco' needs its interval: "
                         "strategy=px.DiLoCo(sync_every=H, outer_lr=0.7, outer_momentum=0.9)")
    return None, strategy


def check_diloco_optimizer(diloco: DiLoCo | None, optimizer) -> None:
    """DiLoCo needs the (inner) optimizer, whose parameters its fragments split: checked
    before any collective (what its other options cannot be: model/spec.py's rows)."""
    if diloco is None:
        return
    if optimizer is None:
        raise ValueError("strategy=px.DiLoCo(...) needs the optimizer (the inner one, whose "
                         "steps it counts): px.prepare(model, optimizer, strategy=...)")
    trainable = sum(1 for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    if diloco.fragments > trainable:
        raise ValueError(f"DiLoCo(fragments={diloco.fragments}): this optimizer has "
                         f"{trainable} trainable parameter(s), and a fragment holds whole "
                         f"parameters: give fragments={trainable} or fewer")

def inner_comm(comm: Comm) -> Comm:
    """The world of one that the inner steps' engine runs on: no process group, so nothing it
    issues communicates."""
    return Comm(None, name="diloco:inner", steps=comm.steps, device=comm.device)


def attach(diloco: DiLoCo | None, model, engine, optimizer, comm: Comm) -> OuterSync | None:
    """The outer step, run after every optimizer.step() (None when not DiLoCo)."""
    if diloco is None:
        return None
    outer = OuterSync(diloco, engine, model, comm)
    engine.watch_steps(optimizer, outer.after_step)
    return outer
