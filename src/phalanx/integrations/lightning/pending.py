"""The module `fabric.setup_module(model)` receives from `PhalanxStrategy`.

[Note: Fabric's setup_module, then setup_optimizers]
Fabric documents an order for sharded strategies: `model = fabric.setup_module(model)`, then
the optimizer built over `model.parameters()`, then `optimizer = fabric.setup_optimizers(
optimizer)`. `px.prepare` takes the model and its optimizer together, because the engine adopts
the optimizer as it is built (under zero1/2/3 the optimizer steps this rank's master pieces:
engine/optim.py) and refuses a sharded strategy without one. So `setup_module` prepares nothing
yet: it hands Fabric this module, whose one child is the user's model, so that the parameters
the optimizer is then built over are the model's own; `setup_optimizers` prepares the model
with that optimizer, exactly as `fabric.setup(model, optimizer)` would have, and from then on
this module forwards to the prepared model. A model set up alone and used before any optimizer
is set up (a forward, `fabric.save`, inference with no optimizer at all) is prepared alone at
that first use, as `px.prepare(model)`; an optimizer set up after that is refused.

The prepared model is kept beside the child, not as one: the model's parameters then have the
same names under what Fabric returns before and after `setup_optimizers`, and the same as
after `fabric.setup(model, optimizer)` ("_forward_module.module.<name>": a prepared model holds
the user's as its child `module` too).

Fabric hands this module (not the prepared one) to the strategy's hooks (`no_backward_sync`,
`clip_gradients`, `save`, `load`): they take `prepared_module(module)`.
"""

from __future__ import annotations

import torch

__all__ = ["PendingModule", "prepared_module"]

PENDING, ALONE, WITH_OPTIMIZER = "pending", "prepared alone", "prepared with its optimizer"


class PendingModule(torch.nn.Module):
    """The user's model until an optimizer prepares it, then the prepared model (see the Note).
    `prepare(module, optimizer)` is the strategy's px.prepare."""

    def __init__(self, module: torch.nn.Module, prepare) -> None:
        super().__init__()
        self.module = module
        self.__dict__["_prepare"] = prepare
        self.__dict__["state"] = PENDING
        self.__dict__["prepared"] = None  # not a child: see the Note

    def prepare_with(self, optimizer) -> None:
        """`fabric.setup_optimizers(optimizer)`: prepare the model with it."""
        if self.state == WITH_OPTIMIZER:
            raise ValueError(
                "PhalanxStrategy prepares a model with one optimizer (px.prepare), and this model "
                "has its optimizer already: use one optimizer with several param groups")
        if self.state == ALONE:
            raise ValueError(
                "this model was used (a forward, fabric.save, ...) before fabric.setup_optimizers"
                ", so phalanx prepared it then without an optimizer, and it cannot take one now: "
                "call fabric.setup_optimizers(optimizer) right after fabric.setup_module(model), "
                "before the model's first use (or fabric.setup(model, optimizer))")
        self.__dict__["prepared"] = self._prepare(self.module, optimizer)
        self.__dict__["state"] = WITH_OPTIMIZER

    def ready(self) -> torch.nn.Module:
        """The prepared model; at the first use of a model no optimizer was set up for, the
        model prepared alone."""
        if self.state == PENDING:
            try:
                prepared = self._prepare(self.module, None)
            except ValueError as exc:
                raise ValueError(
                    "this model, set up by fabric.setup_module(model), was used before "
                    "fabric.setup_optimizers(optimizer), so phalanx prepared it alone, and "
                    f"px.prepare refused: {exc}. Set up its optimizer before its first use "
                    "(or fabric.setup(model, optimizer))") from exc
            self.__dict__["prepared"] = prepared
            self.__dict__["state"] = ALONE
        return self.prepared

    def forward(self, *args, **kwargs):
        return self.ready()(*args, **kwargs)


def prepared_module(module):
    """The prepared model behind what Fabric hands the strategy (see the Note); any other
    module as it is."""
    return module.ready() if isinstance(module, PendingModule) else module
