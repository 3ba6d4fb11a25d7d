"""The public calls' arguments in the wrong place, named before anything happens.

`px.prepare(model, "sgd")`, `px.save(model, "ckpt")` or `px.data_loader(32, dataset)` used to
fail deep inside (`'str' object has no attribute 'param_groups'`). Each entry point checks here
first that what it was given is of the kind it takes, and raises a TypeError that names the
call, what was passed, what goes there, and the call that works. Every rank runs the same
check on the same kinds of values before any collective, so every rank raises it and none
waits for another.
"""

from __future__ import annotations

import os

import torch

from .strategies import is_strategy_name

__all__ = ["check_prepare", "check_checkpoint_call", "check_path", "check_model",
           "check_data_loader", "is_optimizer"]



def _shown(value) -> str:
    """What was passed, in a few words: 'the module Linear', 'the optimizer SGD', "str 'sgd'"."""
    if isinstance(value, torch.nn.Module):
        return f"the module {type(value).__name__}"
    if is_optimizer(value):
        return f"the optimizer {type(value).__name__}"
    text = " ".join(repr(value).split())
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def is_optimizer(value) -> bool:
    """A torch optimizer, or one that behaves as one (param_groups, step, state_dict), as
    wrappers such as Accelerate's and bitsandbytes' optimizers do."""
    return isinstance(value, torch.optim.Optimizer) or all(
        hasattr(value, name) for name in ("param_groups", "step", "state_dict"))


def _optimizer_mistake(call: str, optimizer) -> str:
    """What is wrong with `optimizer` given where an optimizer goes, and the call that works."""
    example = "torch.optim.SGD(model.parameters(), lr=0.1)"
    if is_strategy_name(optimizer):
        return (f"{call}: the second argument is the optimizer, and {optimizer!r} is a "
                f"strategy: pass it as a keyword, px.prepare(model, optimizer, "
                f"strategy={optimizer!r}) (or px.prepare(model, strategy={optimizer!r}) "
                "without an optimizer)")
    if isinstance(optimizer, str):
        return (f"{call}: the second argument is the optimizer itself, a torch.optim.Optimizer "
                f"built over model.parameters() such as {example}, not its name "
                f"{optimizer!r}; the strategy is a keyword: strategy='ddp'")
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return (f"{call}: the optimizer class {optimizer.__name__} was passed; pass an optimizer "
                f"built over the model's parameters, {optimizer.__name__}(model.parameters(), "
                "lr=...)")
    return (f"{call}: the optimizer goes there, a torch.optim.Optimizer built over "
            f"model.parameters() such as {example} (or None), not {_shown(optimizer)}")


def check_prepare(model, optimizer) -> None:
    """`px.prepare(model, optimizer=None, strategy=..., ...)`'s first two arguments."""
    call = "px.prepare(model, optimizer, strategy=...)"
    if not isinstance(model, torch.nn.Module):
        swapped = " (the model comes first, then its optimizer)" if is_optimizer(model) else ""
        raise TypeError(f"{call}: the model goes first, a torch.nn.Module, not "
                        f"{_shown(model)}{swapped}")
    if optimizer is not None and not is_optimizer(optimizer):
        raise TypeError(_optimizer_mistake(call, optimizer))


def check_path(call: str, path, what: str, example: str) -> None:
    """`path` is a file system path (str or os.PathLike), or a TypeError that names `call`."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{call}: the first argument is {what} (a str or os.PathLike), not "
                        f"{_shown(path)}: {example}")


def check_model(call: str, model, example: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{call}: the model goes there (a torch.nn.Module, prepared or not), "
                        f"not {_shown(model)}: {example}")


def check_checkpoint_call(call: str, path, model, optimizer) -> None:
    """`px.save(path, model=..., optimizer=...)` and `px.load(path, model, optimizer)`."""
    example = f"{call}('checkpoints/step-100', model=model, optimizer=optimizer)"
    check_path(call, path, "the checkpoint's directory", example)
    if model is not None:
        check_model(f"{call}(model=...)", model, example)
    if optimizer is not None and not is_optimizer(optimizer):
        raise TypeError(f"{call}: optimizer= takes the optimizer px.prepare returned, not "
                        f"{_shown(optimizer)}: {example}")


def check_data_loader(dataset, batch_size) -> None:
    """`px.data_loader(dataset, batch_size, ...)`: a dataset first, then a number."""
    call = "px.data_loader(dataset, batch_size, ...)"
    if isinstance(dataset, (int, float, str, bytes)) or not (
            hasattr(dataset, "__getitem__") or hasattr(dataset, "__iter__")):
        swapped = ""
        if isinstance(dataset, int) and not isinstance(batch_size, (int, float)):
            swapped = f"; the dataset comes first: px.data_loader(dataset, {dataset})"
        raise TypeError(f"{call}: the first argument is the dataset (a torch Dataset, or "
                        f"anything with __len__ and __getitem__, or an IterableDataset), not "
                        f"{_shown(dataset)}{swapped}")
