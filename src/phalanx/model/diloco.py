"""`px.DiLoCo`: the strategy that communicates once every H optimizer steps, and how
`px.prepare` builds it.

    model, optimizer = px.prepare(model, optimizer,
                                  strategy=px.DiLoCo(sync_every=50, outer_lr=0.7, outer_momentum=0.9))

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

from ..collectives import Comm
from ..engine.diloco import OuterSync
from .precision import COMM_DTYPES

__all__ = ["DiLoCo", "split_strategy", "check_diloco_options", "inner_comm", "attach"]


@dataclass(frozen=True)
class DiLoCo:
    """DiLoCo (Douillard et al. 2023, arXiv:2311.08105) as `px.prepare(strategy=...)`.

    sync_every: H, the optimizer steps between two syncs (1 or more).
    outer_lr, outer_momentum, nesterov: the outer SGD that steps the shared weights with the
        averaged pseudo-gradient (the paper's 0.7, 0.9, Nesterov by default); with
        outer_momentum 0 there is no momentum and `nesterov` is not used.
    comm_dtype: None (the masters' dtype), torch.bfloat16 or torch.float16 ('bf16', 'fp16'):
        the dtype the pseudo-gradient is averaged in (half the bytes of fp32; the paper's
        successors average it in fp16 or less, OpenDiLoCo arXiv:2407.07852).

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
    says how many (a save right after a sync loses none).
    """
    # The checkpoint's layout: [Note: a DiLoCo checkpoint] in checkpoint/diloco.py.

    sync_every: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    comm_dtype: torch.dtype | None = None

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
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"DiLoCo(nesterov={self.nesterov!r}): True or False")
        try:
            wire = COMM_DTYPES[self.comm_dtype]
        except (KeyError, TypeError):
            raise ValueError(f"DiLoCo(comm_dtype={self.comm_dtype!r}): None, torch.bfloat16, "
                             "torch.float16 or torch.float32 (or 'bf16', 'fp16', 'fp32')") \
                from None
        object.__setattr__(self, "comm_dtype", wire)


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


def check_diloco_options(diloco: DiLoCo | None, optimizer, *, comm_dtype, sync_batchnorm,
                         check_replicas_every) -> None:
    """What px.prepare's other options cannot be under DiLoCo (before any collective)."""
    if diloco is None:
        return
    if optimizer is None:
        raise ValueError("strategy=px.DiLoCo(...) needs the optimizer (the inner one, whose "
                         "steps it counts): px.prepare(model, optimizer, strategy=...)")
    if comm_dtype is not None:
        raise ValueError("comm_dtype= compresses gradients, which DiLoCo never sends; give the "
                         "pseudo-gradient's dtype to DiLoCo: px.DiLoCo(sync_every=H, "
                         "comm_dtype=torch.bfloat16)")
    if sync_batchnorm:
        raise ValueError("sync_batchnorm=True communicates in every forward, and DiLoCo's inner "
                         "steps communicate nothing (BatchNorm statistics are averaged at each "
                         "sync); leave sync_batchnorm False")
    if check_replicas_every is not None:
        raise ValueError("check_replicas_every compares replicas that DiLoCo lets differ "
                         "between syncs; leave it None")


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
