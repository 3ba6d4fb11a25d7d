"""Which optimizers a sharded or mixed-precision engine may step, and how: a declaration per
class, open to a user's own.

[Note: element-wise and matrix-wise optimizers]
The engine hands the optimizer what this rank holds of each parameter (engine/flat.py's master
pieces: under zero1, zero2 and zero3 a slice of a flat buffer that cuts parameters anywhere).
That is exact for an *element-wise* optimizer, whose update of an element depends only on that
element's gradient, its own state and the group's hyper-parameters (SGD, Adam, AdamW, ...).
A *matrix-wise* optimizer needs all of some parameters at once: Muon orthogonalises each 2-D
update by Newton-Schulz iterations over the whole matrix; Adafactor keeps row and column
factors of each matrix and scales every update by the root mean square of the whole parameter
(the vectors too). Such a parameter is stepped whole on one owner rank (engine/owners.py), and
the rest of the optimizer's parameters stay on the flat path. `whole(group, param)` says which
parameters need it, so an optimizer with an element-wise group (a Muon whose AdamW group holds
the biases and norms) shards each group its own way.

An optimizer of neither kind (LBFGS, whose step re-evaluates the loss over all parameters) is
refused under sharding and mixed precision, saying how to declare it. A subclass takes the
declaration of its nearest declared base class, as `isinstance` would.

torchao's low-bit optimizers (AdamW8bit, AdamW4bit, ...) are element-wise in their update but
keep their state quantized in blocks of `block_size` consecutive elements of a parameter, one
scale per block: they shard when every shard boundary falls on a block boundary of the
parameter it cuts (`block_size`, and [Note: state in blocks] in optim.py). bitsandbytes' 8-bit
optimizers keep their state in a layout of their own and are refused under sharding, naming
torchao's as the way.
"""

from __future__ import annotations

from typing import Callable

import torch

from .chained import ChainedOptimizer

__all__ = ["element_wise", "matrix_wise", "whole_rule", "check_declared", "declared_names",
           "block_size"]

WholeRule = Callable[[dict, torch.Tensor], bool]


def _every(group: dict, param: torch.Tensor) -> bool:
    return True


# class -> None (element-wise) or a WholeRule (matrix-wise); filled below and by users
_DECLARED: dict[type, WholeRule | None] = {}


def element_wise(cls: type) -> type:
    """`px.element_wise(cls)`: declare that `cls` updates each element from its own gradient,
    state and hyper-parameters alone, so each rank may step a slice of any parameter. Returns
    the class (usable as a decorator)."""
    _check_class(cls)
    _DECLARED[cls] = None
    return cls


def matrix_wise(cls: type | None = None, *, whole: WholeRule | None = None):
    """`px.matrix_wise(cls, whole=None)`: declare that `cls` needs some parameters whole to
    update them; under zero1, zero2 and zero3 each such parameter is stepped on one owner rank
    (owners spread so each rank steps about 1/N of them) and the rest stay sharded as for an
    element-wise optimizer. `whole(group, param) -> bool` picks the parameters (default:
    every one). Usable as a decorator, bare or with `whole=`; returns the class."""
    if cls is None:
        return lambda c: matrix_wise(c, whole=whole)
    _check_class(cls)
    _DECLARED[cls] = whole or _every
    return cls


def _check_class(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"declare an optimizer class (a subclass of torch.optim.Optimizer), "
                        f"not {cls!r}")


def _declaration(optimizer) -> tuple[bool, WholeRule | None]:
    """(declared, rule) for the nearest declared class in `optimizer`'s MRO; torchao's
    low-bit optimizers are element-wise (their blocks: `block_size`); a chain of optimizers
    (chained.py) is declared when each of its optimizers is, each group taking the rule of
    the optimizer it belongs to."""
    if isinstance(optimizer, ChainedOptimizer):
        kinds = [_declaration(o) for o in optimizer.optimizers]
        if not all(declared for declared, _ in kinds):
            return False, None
        if all(rule is None for _, rule in kinds):
            return True, None
        rules = {id(o): rule for o, (_, rule) in zip(optimizer.optimizers, kinds)}

        def rule(group, param):
            own = rules[id(optimizer.optimizer_of(group))]
            return own is not None and own(group, param)
        return True, rule
    for cls in type(optimizer).__mro__:
        if cls in _DECLARED:
            return True, _DECLARED[cls]
    if block_size(optimizer) is not None:
        return True, None
    return False, None


def block_size(optimizer) -> int | None:
    """The block of a torchao low-bit optimizer's quantized state (elements of a parameter
    sharing one scale: 256 for AdamW8bit, 128 for AdamW4bit), None for any other."""
    if isinstance(optimizer, ChainedOptimizer):
        sizes = [b for b in map(block_size, optimizer.optimizers) if b is not None]
        return max(sizes) if sizes else None
    if type(optimizer).__module__.startswith("torchao.optim") \
            and isinstance(getattr(optimizer, "block_size", None), int) \
            and hasattr(optimizer, "_new_buffer") and hasattr(optimizer, "_subclass_zeros"):
        return optimizer.block_size
    return None


def whole_rule(optimizer) -> WholeRule | None:
    """The rule picking the parameters `optimizer` needs whole, None for an element-wise one."""
    return _declaration(optimizer)[1]


def declared_names() -> tuple[list[str], list[str]]:
    """(element-wise, matrix-wise) class names, for messages and docs."""
    return ([c.__name__ for c, r in _DECLARED.items() if r is None],
            [c.__name__ for c, r in _DECLARED.items() if r is not None])


def check_declared(optimizer) -> None:
    """Refuse an optimizer of neither kind (see the Note), naming the way out."""
    if _declaration(optimizer)[0]:
        return
    if isinstance(optimizer, ChainedOptimizer):  # the first undeclared one, by its own name
        for o in optimizer.optimizers:
            check_declared(o)
    if type(optimizer).__module__.startswith("bitsandbytes"):
        raise ValueError(
            f"bitsandbytes' {type(optimizer).__name__} keeps its 8-bit state in a layout of its "
            "own, which phalanx cannot shard or step in pieces; use torchao's "
            "(torchao.optim.AdamW8bit, AdamW4bit: the same block-wise 8-bit state, sharded on "
            "block bounds), or strategy='ddp' with precision='fp32'")
    elementwise, matrixwise = declared_names()
    raise ValueError(
        f"{type(optimizer).__name__} is not an optimizer whose update is element-wise, so "
        f"sharding or mixed precision would change its update; use one of "
        f"{', '.join(elementwise)} (element-wise) or {', '.join(matrixwise)} (matrix-wise: "
        "each matrix stepped whole on one rank), declare your class with "
        "px.element_wise(cls) or px.matrix_wise(cls, whole=...) if its update is either, or "
        "use strategy='ddp' with precision='fp32'")


for _name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam",
              "RMSprop", "Rprop"):
    if hasattr(torch.optim, _name):
        element_wise(getattr(torch.optim, _name))
# Muon: every parameter it holds is a matrix (its constructor refuses others) and is
# orthogonalised whole. Adafactor: row/column factors of each matrix, and every update (of a
# vector too) scaled by the parameter's and the update's root mean square.
for _name in ("Muon", "Adafactor"):
    if hasattr(torch.optim, _name):
        matrix_wise(getattr(torch.optim, _name))
