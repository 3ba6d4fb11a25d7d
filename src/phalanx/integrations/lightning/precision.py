"""Lightning's precision names, translated to phalanx's.

Lightning turns `Trainer(precision=...)` / `Fabric(precision=...)` into a precision plugin and
hands it to the strategy. Under `PhalanxStrategy` phalanx does the mixed precision itself
(`px.prepare(precision=...)`: bf16/fp16 compute with fp32 master weights, fp16 with dynamic
loss scaling), so Lightning's autocast plugin must not run a second time around it:

| Lightning      | px.prepare | plugin Lightning keeps                                    |
|----------------|------------|-----------------------------------------------------------|
| "32-true"      | "fp32"     | a plain one                                               |
| "64-true"      | "fp32"     | Lightning's double one: it casts the module and the inputs |
|                |            | to float64, and phalanx's "fp32" keeps the parameters' own |
|                |            | dtype, so the masters, gradients and optimizer state are   |
|                |            | float64 as under DDPStrategy                               |
| "bf16-mixed"   | "bf16"     | a plain one                                               |
| "16-mixed"     | "fp16"     | a plain one (phalanx scales the loss)                      |

Everything else is refused by name: Lightning's "bf16-true"/"16-true" plugins cast the weights
themselves and step them in half precision, rounding small updates away (phalanx's own
`precision="bf16-true"`, given to px.prepare, steps in fp32 and rounds stochastically: not
reachable through Lightning's plugin); transformer-engine, bitsandbytes and custom plugins
change the model in ways phalanx does not know.

For the Trainer the kept plugin also routes clipping (`gradient_clip_val`) to
`px.clip_grad_norm_`, the norm over every rank's shards (under zero2 and zero3 a parameter's
`.grad` is not where its gradient lives). The optimizer step stays Lightning's:
`optimizer.step(closure)`, whose closure (training_step, backward) a prepared optimizer runs
before its own step.
"""

from __future__ import annotations

from lightning.fabric.plugins.precision import (
    DoublePrecision as FabricDouble,
    Precision as FabricPrecision,
)
from lightning.pytorch.plugins.precision import (
    DoublePrecision as TrainerDouble,
    Precision as TrainerPrecision,
)

import phalanx as px

__all__ = ["PRECISIONS", "phalanx_precision", "trainer_plugin", "fabric_plugin"]

# Lightning's name -> px.prepare's
PRECISIONS = {"32-true": "fp32", "64-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}
_KNOWN = (TrainerPrecision, TrainerDouble, FabricPrecision, FabricDouble)


def phalanx_precision(plugin) -> str:
    """px.prepare's precision for Lightning's `plugin`; a clear error for one with none."""
    name = getattr(plugin, "precision", None)
    known = type(plugin).__module__.startswith("lightning.") and isinstance(plugin, _KNOWN)
    if name not in PRECISIONS or not known:
        what = repr(name) if known else f"the plugin {type(plugin).__name__}"
        raise ValueError(
            f"PhalanxStrategy does not support precision {what}: it maps Lightning's "
            "'32-true', '64-true', 'bf16-mixed' and '16-mixed' to phalanx's fp32, fp32 in "
            "float64, bf16 and fp16 (each with fp32 master weights); Lightning's 'bf16-true' "
            "and '16-true' plugins keep and step the weights in half precision themselves, "
            "which phalanx does not take over: use precision='bf16-mixed', or phalanx's own "
            "px.prepare(..., precision='bf16-true') outside Lightning")
    return PRECISIONS[name]


def _is_double(plugin) -> bool:
    return getattr(plugin, "precision", None) == "64-true"


class _PhalanxClipping:
    """What the Trainer's precision plugin does differently under PhalanxStrategy: clipping
    (see the module docstring). `self.model` is a callable giving the prepared model."""

    model = None  # set by trainer_plugin

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        px.clip_grad_norm_(self.model(), clip_val)

    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        raise ValueError(
            "PhalanxStrategy clips by the global norm over every rank's shards "
            "(px.clip_grad_norm_); gradient_clip_algorithm='value' is not supported: use "
            "Trainer(gradient_clip_algorithm='norm') (the default)")


class _TrainerPlain(_PhalanxClipping, TrainerPrecision):
    pass


class _TrainerDouble(_PhalanxClipping, TrainerDouble):
    pass


def trainer_plugin(plugin, prepared_model):
    """The plugin the Trainer keeps for Lightning's `plugin` (checked by phalanx_precision);
    `prepared_model()` gives the model phalanx prepared, for clipping."""
    kept = _TrainerDouble() if _is_double(plugin) else _TrainerPlain()
    kept.precision = plugin.precision  # what trainer.precision reports: the user's choice
    kept.model = prepared_model
    return kept


def fabric_plugin(plugin):
    """The plugin Fabric keeps for Lightning's `plugin` (checked by phalanx_precision)."""
    kept = FabricDouble() if _is_double(plugin) else FabricPrecision()
    kept.precision = plugin.precision
    return kept
