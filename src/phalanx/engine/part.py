"""A part: a feature that runs beside a strategy, as checkpoints see it.

PowerSGD's compressor (powersgd.py) and `staleness=1`'s delayed gradients (delayed.py) are
parts of an engine (`Engine.parts()`); DiLoCo's outer step (diloco.py) is a part of the
prepared model, which holds it beside its engine. Each keeps state across steps that a
checkpoint must hold for a resume to go on as the run would have, and checkpoint/ reaches that
state through this interface alone: it walks the parts and names none of them.

[Note: a part in a checkpoint]
A part's tensors are stored under its `name`, `<name>/<key>` (`powersgd/`, `grad/`, `diloco/`:
the names checkpoints have always had), and its small values (counts, a schedule) in the small
state (state.pt) at `small_at`. At a save every rank calls every part's `state(saving)`, in the
order of the parts, so a part may run a collective there (PowerSGD's mean of the errors); it
returns this rank's ranges of its tensors, each range written by one rank only (the part says
which: `saving.writes(name)` is whether this rank writes the model tensor `name`, for a tensor
that follows a parameter's layout), and its small values, of which rank 0's are kept. A range
`like` a model tensor has that tensor's shape in the manifest; any other is flat. At a load,
after the model and the optimizer, every part's `load(loading)` takes its state back from
whatever the checkpoint holds: nothing of it (saved without the part) is a fresh start. What a
checkpoint holds for a kind of part that the loading model does not have is that kind's
`left_out(loading)` to speak of (part_kinds.py lists the kinds): it warns where the load loses
something, or says nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["Part", "Range", "Saved", "Saving", "Loading"]


@dataclass
class Range:
    """Elements [start, end) of the flattened tensor `name`, as a 1-D tensor. In a part's
    `Saved`, `name` is the key after the part's name, and `like` the model tensor whose shape
    the whole tensor has (None: flat, as long as its ranges reach)."""
    name: str
    start: int
    end: int
    values: torch.Tensor
    like: str | None = None


@dataclass
class Saved:
    """What a part gives a save: this rank's ranges of its tensors, and its small values
    (picklable; rank 0's are kept, None keeps nothing)."""
    ranges: list[Range] = field(default_factory=list)
    small: object = None


class Saving(Protocol):
    """What a save tells a part (checkpoint/parts.py makes it)."""

    comm: object                   # the prepared model's Comm: rank, world, its collectives
    names: dict[int, str]          # id(tensor) -> its name in the model (the module's names)
    optimizer: object | None       # the optimizer saved with the model, or None

    def writes(self, name: str) -> bool:
        """Whether this rank writes the model tensor `name` (its shards, where it is sharded)."""


class Loading(Protocol):
    """What a load tells a part, after the model and the optimizer are loaded."""

    comm: object
    names: dict[int, str]
    optimizer: object | None  # the optimizer loaded with the model, or None
    prepared: bool            # the model is a prepared one (False: a plain module)
    loaded: set[str]          # the model tensors whose saved values were loaded
    world_size: int           # the world size of the save
    small: object             # the part's small values as saved, or None

    def keys(self) -> list[str]:
        """The part's tensors in the checkpoint, by key (after `<name>/`)."""

    def numel(self, key: str) -> int: ...
    def read(self, key: str, start: int, end: int) -> torch.Tensor: ...
    def read_into(self, key: str, start: int, end: int, out: torch.Tensor) -> None: ...

    def warn(self, message: str) -> None:
        """A warning, attributed to the line that called px.load."""


class Part(Protocol):
    """A feature beside the strategy (see the module's docstring). A class that is one says
    so by deriving from this protocol, which gives it the defaults below."""

    name: str                  # its tensors' prefix in a checkpoint: `<name>/<key>`
    small_at: tuple[str, ...]  # where state.pt keeps its small values (a path of keys)

    def state(self, saving: Saving) -> Saved:
        """This rank's part of the state to save (every rank calls it: it may be a collective)."""

    def load(self, loading: Loading) -> None:
        """Take the saved state back (see [Note: a part in a checkpoint])."""

    def model_values(self) -> dict[int, torch.Tensor]:
        """The values the model's tensors are saved as where the live ones are not what a
        checkpoint should hold (id(tensor) -> tensor); DiLoCo's: the weights of the last sync."""
        return {}

    @classmethod
    def left_out(cls, loading: Loading) -> None:
        """A checkpoint loaded into a model without this kind of part: say what is lost."""
