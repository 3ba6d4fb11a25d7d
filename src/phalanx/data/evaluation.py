"""`px.gather_for_metrics`: evaluation outputs of the whole dataset, each sample exactly once.

    loader = px.data_loader(eval_set, batch_size=64, shuffle=False)
    predictions = []
    for x, y in loader:
        predictions.append(px.gather_for_metrics(model(x).argmax(-1), loader))
    predictions = torch.cat(predictions)   # len(eval_set) rows, in dataset order, on every rank

Exactness comes from the loader, not from trimming here: `px.data_loader` never repeats a
sample to even out the last batch, and gives every rank the same number of batches (a rank
with nothing left gets an empty batch, see `phalanx.data.loader`). So concatenating every
rank's outputs of each batch, in rank order, is already the dataset once; with
`shuffle=False` it is also in dataset order. The loader argument is checked to be such a
loader: a plain DataLoader over PyTorch's DistributedSampler pads by repeating samples, which
would be counted twice.
"""

from __future__ import annotations

import collections.abc as abc

import torch

from ..comm import continuation
from ..comm.collectives import Comm
from ..world.runtime import default_comm
from .gathering import gather_with
from .loader import DistributedLoader

__all__ = ["gather_for_metrics"]


def gather_for_metrics(value, loader):
    """This batch's outputs from every rank, concatenated in rank order (a collective).

    `value` is a tensor whose first dimension is the batch (0-d tensors are stacked, one per
    rank), a list of per-sample objects (lists are concatenated), or a tuple / dict / named
    tuple of those, gathered field by field. The collectives go through the job's default
    `Comm` (the loader splits the data over the whole job), tagged "gather_for_metrics".

    Under `phalanx run --on-failure continue` a gather during which a rank is lost returns the
    value's structure with no samples in it (zero rows, an empty list), and the loader's next
    batch is that batch again, split over the ranks left: what the loop gathered still holds
    each sample once.
    """
    # See [Note: an evaluation redone] in continuing/gathers.py
    if not isinstance(loader, DistributedLoader):
        raise TypeError(
            f"px.gather_for_metrics needs the loader made by px.data_loader(...), got "
            f"{type(loader).__name__}: other loaders may repeat samples to even out ranks, "
            f"which would count them twice; build the evaluation loader with px.data_loader")
    if loader.drop_last_step:
        raise ValueError(
            "px.gather_for_metrics over a loader with drop_last=True would miss the last "
            "samples of the dataset: build the evaluation loader with drop_last=False")
    comm = default_comm()
    sampler = loader.distributed_sampler  # None: a stream's loader
    return continuation.now().gather_for_metrics(sampler.replay if sampler is not None else None,
                                                 lambda: _gather_cat(value, comm),
                                                 lambda: _nothing(value), comm)


def _gather(value, comm: Comm) -> list:
    return gather_with(value, comm, tag="gather_for_metrics")


def _gather_cat(value, comm: Comm):
    if isinstance(value, torch.Tensor):
        parts = _gather(value, comm)
        return torch.stack(parts) if value.dim() == 0 else torch.cat(parts)
    if isinstance(value, abc.Mapping):
        return type(value)({k: _gather_cat(v, comm) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_gather_cat(v, comm) for v in value))
    if isinstance(value, tuple):
        return tuple(_gather_cat(v, comm) for v in value)
    if isinstance(value, list):
        return [item for part in _gather(value, comm) for item in part]
    raise _not_gathered(value)


def _nothing(value):
    """What `_gather_cat` returns when no rank's values come: the same structure, no samples
    (a tensor's zero rows; a 0-d tensor's stack of none; an empty list)."""
    if isinstance(value, torch.Tensor):
        return value.detach()[:0] if value.dim() else value.detach().reshape(1)[:0]
    if isinstance(value, abc.Mapping):
        return type(value)({k: _nothing(v) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_nothing(v) for v in value))
    if isinstance(value, tuple):
        return tuple(_nothing(v) for v in value)
    if isinstance(value, list):
        return []
    raise _not_gathered(value)


def _not_gathered(value) -> TypeError:
    return TypeError(
        f"px.gather_for_metrics gathers tensors, lists, and tuples or dicts of them; got "
        f"{type(value).__name__} (for any other object use px.gather)")
