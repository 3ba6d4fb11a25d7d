"""Continue mode for this process: `px.init` starts it here (see the package docstring).

Imported by phalanx/__init__.py, which puts `start` where `elastic.start` finds it: the modules
below every other part of phalanx (runtime, the checkpoint, the data loader) reach continue
mode only through `elastic/__init__.py`, and this module sits above all of them.
"""

from __future__ import annotations

import torch.distributed as dist

from .. import environment
from ..process import state
from . import _starter
from .events import Events
from .gate import gate
from .membership import Membership
from .steps import StepBoundary

__all__ = ["start"]


def start(env, backend: str, timeout, device) -> None:
    client = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)
    life = environment.value("PHALANX_JOINING") or 0
    m = Membership(client, env.rank, env.world_size, life, backend, timeout, device)
    steps = StepBoundary(m)
    now = state.continuing
    now.membership, now.steps, now.client = m, steps, client
    gate.active = True
    gate.cut = False
    gate.on_loss = steps.lost
    Events(m, steps)
    m.start()


_starter[:] = [start]
