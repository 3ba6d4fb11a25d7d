"""Reading a device value on the host: the one place phalanx does it, counted.

On a GPU every read of a tensor's value by the host (`.item()`, `.tolist()`, `bool(t)`) waits
for everything queued before it, so the host stops running ahead of the device and the next
kernels start late. phalanx reads a device value once per optimizer step, at the end of the
backward that communicates: which parameters got a gradient on any rank, whether any rank's
loss was non-finite, fp16's overflow flag, and zero3's check that the ranks gathered the same
modules all come back in that one read (engine/flat_engine.py, `FlatEngine._after_backward`). Other
reads are outside the steady step: the first step's launch order, the replica check every K
steps, errors being reported.

Every read goes through `read()`, which counts, so a test on the CPU can assert the number per
step (a proxy for synchronisations on a GPU, where `torch.cuda.set_sync_debug_mode` confirms
it).
"""

from __future__ import annotations

import torch

from ..world.process import state

__all__ = ["read", "count"]


def read(t: torch.Tensor) -> list:
    """`t.tolist()`, counted (see the module's docstring)."""
    state.host.count += 1
    return t.tolist()


def count() -> int:
    """Host reads made through `read()` by this process since `px.init` (`px.shutdown()`
    starts the count again)."""
    return state.host.count
