"""`px.chain_optimizers(muon, adamw)`: several optimizers, each over its own parameters, as the
one optimizer px.prepare takes.

torch's `Muon` takes matrices only, so its documented use pairs it with an AdamW over the
biases, norms and embeddings, two optimizers stepped one after the other. px.prepare adopts one
optimizer (engine/optim.py) and decides per parameter how it shards (optimizer_kinds.py); the
chain is that one optimizer. It holds its optimizers' own param groups (the same dicts, so the
engine's master pieces go into every optimizer's groups when it steps, and a learning rate
scheduler built on either optimizer changes what the chain steps), steps them in order, and
keeps each one's state in that optimizer. Each parameter shards as the optimizer holding it
says: Muon's matrices whole on owner ranks, AdamW's parameters sliced.

The chain's `state_dict()` is one process's format over the groups of every optimizer in order
(the first optimizer's parameters numbered first); `load_state_dict` takes the same and gives
each optimizer its share. Each optimizer's own `state_dict()` stays its own.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

__all__ = ["ChainedOptimizer", "chain_optimizers"]


class _ChainedState(MutableMapping):
    """The chain's `state`: each entry lives in the state of the optimizer holding its tensor."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    def _with(self, key):
        return next((o for o in self.optimizers if key in o.state), None)

    def _holding(self, key):
        return next((o for o in self.optimizers for g in o.param_groups
                     if any(p is key for p in g["params"])), None)

    def __getitem__(self, key):
        owner = self._with(key)
        if owner is None:
            raise KeyError(key)
        return owner.state[key]

    def __setitem__(self, key, value):
        owner = self._with(key) or self._holding(key)
        if owner is None:
            raise KeyError("a tensor that none of the chained optimizers holds")
        owner.state[key] = value

    def __delitem__(self, key):
        owner = self._with(key)
        if owner is None:
            raise KeyError(key)
        del owner.state[key]

    def __iter__(self):
        for o in self.optimizers:
            yield from o.state

    def __len__(self):
        return sum(len(o.state) for o in self.optimizers)

    def clear(self):
        for o in self.optimizers:
            o.state.clear()


class ChainedOptimizer(torch.optim.Optimizer):
    """Optimizers stepped in order as one (see the module's docstring)."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        super().__init__([torch.zeros(1, requires_grad=True)], {})  # hooks and the rest
        self.state = _ChainedState(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        """Every optimizer's own groups, in order (read afresh: torch's load_state_dict gives
        an optimizer new group dicts)."""
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, groups) -> None:
        pass  # Optimizer.__init__'s placeholder group: the chain's are its optimizers' own

    def optimizer_of(self, group: dict):
        """The optimizer whose param group `group` is."""
        return next(o for o in self.optimizers if any(g is group for g in o.param_groups))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for o in self.optimizers:
            own = o.state_dict()
            for index, entry in own["state"].items():
                state[index + offset] = entry
            for group in own["param_groups"]:
                groups.append({**group, "params": [i + offset for i in group["params"]]})
            offset += sum(len(g["params"]) for g in o.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"the saved state has {len(saved)} param groups, this chain of "
                             f"optimizers {len(self.param_groups)}")
        at = 0
        for o in self.optimizers:
            mine = saved[at:at + len(o.param_groups)]
            at += len(o.param_groups)
            ids = [i for g in mine for i in g["params"]]
            state = {}
            for position, saved_id in enumerate(ids):
                entry = state_dict["state"].get(saved_id, state_dict["state"].get(str(saved_id)))
                if entry is not None:
                    state[position] = entry
            groups, position = [], 0
            for g in mine:
                groups.append({**g, "params": list(range(position, position + len(g["params"])))})
                position += len(g["params"])
            o.load_state_dict({"state": state, "param_groups": groups})


def chain_optimizers(*optimizers) -> ChainedOptimizer:
    """`px.chain_optimizers(opt_a, opt_b, ...)`: one optimizer that steps each given one in
    order, each over its own parameters (torch's Muon over the matrices beside an AdamW over
    the rest), to give px.prepare; schedulers stay on the optimizers they were built on."""
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError("px.chain_optimizers takes torch.optim.Optimizer instances, at least "
                        "one: px.chain_optimizers(muon, adamw)")
    seen = {}
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                if id(p) in seen and seen[id(p)] is not o:
                    raise ValueError("a parameter is held by two of the chained optimizers; "
                                     "give each parameter to one of them")
                seen[id(p)] = o
    return ChainedOptimizer(optimizers)
