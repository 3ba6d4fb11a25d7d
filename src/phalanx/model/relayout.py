"""A prepared model's engine built again for another layout of the same options.

Under `phalanx run --on-failure continue` the members of the job change (continuing/): a rank is
lost, a replacement joins. A replicated engine (ddp) does not care: every rank holds the whole
state, and its Comm moves to the new group. A sharded one (zero1, zero2, zero3) holds 1/N of
the state laid out for N ranks and this rank's place among them, so it is built again for the
group as it is now: the old engine gives the optimizer and the parameters back
(`FlatEngine.release`), a new one is built from what `px.prepare` kept (`Build`: its spec) and
takes the prepared model's step clock and watchers; the caller then loads the state into it
(a checkpoint: continuing/joining.py, continuing/steps.py).
"""

from __future__ import annotations

import weakref

from ..engine.policy import SHARD
from .prepare import attach_engine

__all__ = ["needs_relayout", "relayout"]


def needs_relayout(prepared) -> bool:
    """Whether `prepared`'s engine is sharded for another group than its Comm's."""
    engine = prepared._engine
    return engine.policy.optimizer is SHARD and not engine.laid_out_for(prepared._comm)


def relayout(prepared) -> None:
    """Build `prepared`'s engine again over its Comm's group (see the module docstring); its
    masters and optimizer state are left to be loaded."""
    optimizer = prepared._optimizer() if prepared._optimizer is not None else None
    prepared._engine.release()
    engine = attach_engine(prepared.module, optimizer, prepared._comm, prepared._build,
                           prepared._precision)
    prepared._use_engine(engine)
    clock = prepared._clock
    if clock is not None:
        clock.groups = engine.groups()
        clock.across = engine.names_across()
        if optimizer is not None:
            engine.watch_steps(optimizer, clock.step_done)
        if getattr(clock, "continuing_engine", None) is not None:
            clock.continuing_engine = weakref.ref(engine)
    if engine.remote is not None:  # see [Note: served once prepared] in engine/remote.py
        weakref.finalize(prepared, engine.remote.retire, engine.remote_id)
        engine.remote.open(engine.remote_id)
