"""What an engine does across generations of the job's members (`phalanx run --on-failure
continue`, phalanx/continuing/): each `optimizer.step()` asks the step boundary first, a rank that
joins takes the others' launch order and step count, and a sharded engine laid out for another
group gives the model and optimizer back to be built again (model/relayout.py).

A mixin of `FlatEngine` (flat_engine.py), whose attributes it reads.
"""

from __future__ import annotations

import torch

__all__ = ["AcrossGenerations"]


class AcrossGenerations:
    def guard_steps(self, optimizer, before) -> None:
        """Ask `before()` as every `optimizer.step()` of the user's loop begins whether the
        step may change anything (continuing/steps.py); when not, its gradients are dropped first,
        so the optimizer (adopted or the user's own) steps nothing."""
        if self.optim is not None and self.optim.adopted:
            self.optim.before_step = before
        else:
            def pre(opt, args, kwargs):
                if not self.vote.dropped and not before():  # dropped: see engine/vote.py
                    self.drop_grads()
            optimizer.register_step_pre_hook(pre)

    def laid_out_for(self, comm) -> bool:
        """Whether this engine's layout is the one `comm`'s group calls for (same size, same
        place, and the groups made from it: zero3's gathers, the shard service); a sharded
        engine that is not is rebuilt (model/relayout.py)."""
        return self.built_at == comm.regroups and (self.world, self.rank) == (comm.world, comm.rank)

    def release(self) -> None:
        """Stop being the engine of its model, for a rebuilt one (model/relayout.py): the
        optimizer given back, the gathers' hooks taken off, the reducer's hooks disarmed, this
        engine no longer served to peers, and every parameter it holds standalone again (a
        trainable one in its own dtype, a frozen one of zero3's in the dtype it was cast to);
        their values are loaded next."""
        if self.optim is not None:
            self.optim.release()
        if self.gatherer is not None:
            self.gatherer.release()
        self.reducer.disarm()
        if self.remote is not None:
            self.remote.retire(self.remote_id)
        with torch.no_grad():
            for unit in self.all_units:  # zero3's frozen parameters too, in their cast dtype
                for p in unit.members:
                    dtype = unit.master_dtype if p.requires_grad else unit.compute_dtype
                    p.data = torch.zeros(p.shape, dtype=dtype, device=p.device)
                    p.grad = None

    def elastic_state(self) -> dict:
        """What a rank joining a running job takes from the others (continuing/joining.py): the
        launch order, once settled, and the step count."""
        return {"settled": self.world > 1 and not self.reducer.first_order_pending(),
                "order": [b.index for b in self.reducer.buckets], "steps": self.steps.value}

    def set_elastic_state(self, state: dict | None) -> None:
        if state is None:  # no member has the order settled: the next backward settles it
            self.reducer.rearm_first_order()
            return
        self.reducer.adopt_order(state["order"])
        self.steps.value = state["steps"]
