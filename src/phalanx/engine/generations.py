"""What an engine does across generations of the job's members (`phalanx run --on-failure
continue`, phalanx/continuing/): each `optimizer.step()` asks the step boundary first
(`FlatEngine.guard_steps`), a rank that joins takes the others' launch order and step count,
and a sharded engine laid out for another group gives the model and optimizer back to be built
again (`FlatEngine.release`, model/relayout.py).

`Generations` is a part of `FlatEngine` (flat_engine.py): the group its layout was built for,
and the launch order that a joining rank takes from the others, given the engine's reducer.
"""

from __future__ import annotations

from .reducer import GradReducer

__all__ = ["Generations"]


class Generations:
    """One engine's part in continue mode (see the module's docstring)."""

    def __init__(self, comm, reducer: GradReducer):
        self.built_at = comm.regroups  # the Comm's group this layout is for
        self.world, self.rank = comm.world, comm.rank
        self.reducer = reducer

    def laid_out_for(self, comm) -> bool:
        """Whether this engine's layout is the one `comm`'s group calls for (same size, same
        place, and the groups made from it: zero3's gathers, the shard service); a sharded
        engine that is not is rebuilt (model/relayout.py)."""
        return self.built_at == comm.regroups and (self.world, self.rank) == (comm.world, comm.rank)

    def state(self, steps) -> dict:
        """What a rank joining a running job takes from the others (continuing/joining.py): the
        launch order, once settled, and the step count (`steps`: the model's StepCounter)."""
        return {"settled": self.world > 1 and not self.reducer.first_order_pending(),
                "order": [b.index for b in self.reducer.buckets], "steps": steps.value}

    def set_state(self, state: dict | None, steps) -> None:
        """Take `state` (`state()` of a member); None: no member has the order settled, the
        next backward settles it."""
        if state is None:
            self.reducer.rearm_first_order()
            return
        self.reducer.adopt_order(state["order"])
        steps.value = state["steps"]
