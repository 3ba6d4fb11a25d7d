"""Continue mode for this process: `px.init` starts it here (see the package docstring).

phalanx/__init__.py installs `start` in comm/continuation.py, through which `px.init` (and the
engine, the prepared model, the data loader and checkpoints, which stand below this package)
reach continue mode.
"""

from __future__ import annotations

import torch.distributed as dist

from ..comm.gate import gate
from ..world import environment
from ..world.process import state
from .events import Events
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

