"""The strategy names: one list for `px.prepare`, `PhalanxStrategy`, the demo and the planner.

    name    optimizer state    gradients    parameters
    ddp     whole              whole        whole
    zero1   sharded            whole        whole
    zero2   sharded            sharded      whole
    zero3   sharded            sharded      sharded, gathered while a unit computes

"fsdp" is another name for "zero3" (PyTorch's FSDP shards the same three). What each strategy
holds where is the engine's policy table (engine/policy.py).
"""

from __future__ import annotations

__all__ = ["STRATEGIES", "STRATEGY_ALIASES", "strategy_name", "is_strategy_name"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
STRATEGY_ALIASES = {"fsdp": "zero3"}


def strategy_name(name, where: str = "strategy") -> str:
    """The strategy `name` means (any case, the alias resolved), or a ValueError naming what
    `where` takes."""
    if isinstance(name, str):
        lowered = name.lower()
        if lowered in STRATEGIES:
            return lowered
        if lowered in STRATEGY_ALIASES:
            return STRATEGY_ALIASES[lowered]
    names = ", ".join(repr(s) for s in STRATEGIES)
    aliases = ", ".join(f"{a!r} for {s!r}" for a, s in STRATEGY_ALIASES.items())
    raise ValueError(f"unknown {where} {name!r}; choose one of {names} (alias {aliases})")


def is_strategy_name(value) -> bool:
    """Whether `value` is a strategy's name (a mistake for an optimizer, say)."""
    return isinstance(value, str) and (value.lower() in STRATEGIES
                                       or value.lower() in STRATEGY_ALIASES)
