"""phalanx's names in Lightning's strategy registries: `Trainer(strategy="phalanx_zero3")`.

    import phalanx.integrations.lightning  # registers the names below

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="phalanx_zero3")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="phalanx_zero2")

    name               a new
    "phalanx"          PhalanxStrategy("ddp")
    "phalanx_<s>"      PhalanxStrategy("<s>") for each of strategies.py's: ddp, zero1, zero2,
                       zero3, and its alias fsdp (zero3)

Lightning looks a strategy's name up in its front end's registry
(`lightning.pytorch.strategies.StrategyRegistry` for the Trainer,
`lightning.fabric.strategies.STRATEGY_REGISTRY` for Fabric), which it fills at its own import
through the `register_strategies` classmethod of its own strategy classes. It reads no entry
point for strategies (its only entry points add callbacks, read after the strategy is chosen),
so another package's names are there once that package has registered them: importing
`phalanx.integrations.lightning` does, in both registries. `import phalanx` alone cannot: the
base install never imports Lightning.
"""

from __future__ import annotations

import functools

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from ...spec.strategies import STRATEGIES, STRATEGY_ALIASES

__all__ = ["NAMES", "register_names", "register_everywhere"]

# Lightning's name -> px.prepare's strategy
NAMES = {"phalanx": "ddp", **{f"phalanx_{s}": s for s in STRATEGIES},
         **{f"phalanx_{alias}": s for alias, s in STRATEGY_ALIASES.items()}}


def register_names(strategy_registry, strategy_class) -> None:
    """Register every name of NAMES in `strategy_registry`, each giving a new
    `strategy_class(strategy)` when Lightning asks for it. Registering again (a second import
    after a reload) replaces the names with the same."""
    for name, strategy in NAMES.items():
        # the registry calls what it holds with the registered keywords, and its own register()
        # takes `strategy` for the class: so the strategy's name goes in a partial
        strategy_registry.register(name, functools.partial(strategy_class, strategy),
                                   description=f"phalanx's {strategy}: PhalanxStrategy"
                                               f"({strategy!r})", override=True)


def register_everywhere(strategy_class) -> None:
    """The names in the Trainer's registry and in Fabric's."""
    for strategy_registry in (StrategyRegistry, STRATEGY_REGISTRY):
        strategy_class.register_strategies(strategy_registry)
