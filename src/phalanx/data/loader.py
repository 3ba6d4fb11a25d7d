"""`px.data_loader`: a `torch.utils.data.DataLoader` that gives each rank its part of every batch.

    loader = px.data_loader(dataset, batch_size=32)      # batch_size is per rank
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)                  # optional: a full pass advances it
        for batch in loader:
            ...

For a map-style dataset the loader draws from a `px.DistributedSampler` (`loader.sampler`),
whose notes describe the order, the tail of an epoch and resuming. Every rank gets the same
number of batches per epoch; a rank whose share of the last global batch is empty gets an empty
batch: the dataset's first sample collated, then cut to zero rows (tensors keep their other
dimensions; per-sample lists become empty). A model's forward over zero rows gives zero rows,
a sum over them is zero, and `px.global_mean` counts them as nothing.

An `IterableDataset` cannot be indexed, so every rank (and every loader worker) reads the
whole stream and keeps only its own part: the stream is cut into global batches exactly as the
sampler cuts its order (rank r takes the r-th slice of each global batch, the last one split
evenly), and loader worker w of W takes global batches w, w + W, ... Reading the stream once
per process is the price of splitting without overlap; a stream that splits itself by rank
or worker should not be given here. A stream has no order to shuffle, so `shuffle=True` is an
error, and resuming mid-epoch needs a map-style dataset.

On a GPU machine every batch arrives on `px.device()`, as Accelerate's prepared DataLoader
gives it: each tensor in it, nested anywhere in tuples, lists, dicts, namedtuples and
dataclasses, is copied there without blocking the host (from pinned memory), so targets used
outside the model (`F.cross_entropy(model(x), y)`) are already where the outputs are.
`device_placement=False` leaves batches where the workers made them (the CPU). On a CPU-only
rank nothing is moved.
"""

from __future__ import annotations

import collections.abc as abc
import time

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from .._tree import to_device
from ..comm import continuation
from ..observe.step_report import add_data_wait
from ..spec.arguments import check_data_loader
from ..world import runtime
from .sampler import DistributedSampler, check_batch_size, split_evenly
from .seeding import KeyedSamples

__all__ = ["data_loader", "DistributedLoader"]

_OWN_ARGUMENTS = ("sampler", "batch_sampler")


def data_loader(dataset, batch_size: int, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False, device_placement: bool = True,
                **loader_kwargs) -> "DistributedLoader":
    """A DataLoader over `dataset` that gives this rank its part of each global batch.

    `batch_size` is per rank; other keyword arguments (`num_workers`, `collate_fn`,
    `pin_memory`, ...) go to `torch.utils.data.DataLoader`.

    shuffle, seed: each epoch's one global order is a permutation drawn from (seed, epoch)
        (`loader.sampler.set_epoch(epoch)`), the same at any world size; False: the dataset's
        order.
    drop_last: leave out the last global batch when it is short; False (the default) splits
        it as evenly as possible and every rank still gets the same number of batches, some
        possibly empty: zero rows with the structure of an ordinary batch, which add nothing
        to a sum or to `px.global_mean`.

    device_placement: when this rank computes on a device other than the CPU (`px.device()`,
        a GPU), every tensor of each batch (nested anywhere in tuples, lists, dicts,
        namedtuples and dataclasses) is moved there with `non_blocking=True` before the loop
        sees it, so inputs and targets alike are on the model's device. False: batches stay
        where collate made them (the CPU), for a loop that moves them itself. On a CPU rank
        it changes nothing. (Other containers, such as a `UserDict`, are left as they are.)
    `pin_memory` defaults to True when this rank computes on a GPU, so the copy of each batch
    to it does not block the host.

    `len(loader)` is the batches per rank in a whole epoch, as for a torch DataLoader, before
    and after `px.load` restores `loader.sampler` mid-epoch; `loader.batches_left()` is what
    is left of the epoch in progress (after such a load, the batches the next pass yields).
    """
    check_data_loader(dataset, batch_size)
    here = runtime.device()
    loader_kwargs.setdefault("pin_memory", here.type == "cuda")
    device = here if device_placement and here.type != "cpu" else None
    return DistributedLoader(dataset, batch_size, shuffle=shuffle, seed=seed,
                             drop_last=drop_last, device=device, **loader_kwargs)


class DistributedLoader(DataLoader):
    """The loader `px.data_loader` returns; `gather_for_metrics` recognises it.

    Its `sampler` is the `px.DistributedSampler` (map-style datasets), and it reports to the
    sampler each batch it yields, so a sampler state taken inside the loop counts exactly the
    batches the loop received, whatever the workers have prefetched. `device` (None: none) is
    where it moves each batch's tensors before yielding it (`px.data_loader`'s
    `device_placement`).
    """

    def __init__(self, dataset, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, device: torch.device | None = None, **loader_kwargs):
        check_batch_size(batch_size)
        for name in _OWN_ARGUMENTS:
            if name in loader_kwargs:
                raise TypeError(f"px.data_loader makes its own {name}; do not pass {name}=")
        collate_fn = loader_kwargs.pop("collate_fn", None) or default_collate
        self.per_rank_batch_size = batch_size
        self.distributed_sampler = None
        if isinstance(dataset, IterableDataset):
            if shuffle:
                raise ValueError(
                    "px.data_loader cannot shuffle an IterableDataset (a stream has no order "
                    "to permute): pass shuffle=False and shuffle inside the stream if needed")
            stream = RankSplitStream(dataset, batch_size, drop_last,
                                     runtime.rank(), runtime.world_size())
            super().__init__(stream, batch_size=None,
                             collate_fn=EmptySafeCollate(collate_fn), **loader_kwargs)
        else:
            sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed,
                                         drop_last=drop_last, batch_size=batch_size)
            # Workers make each sample with generators keyed by its place in the epoch
            # ([Note: a sample's own generators] in seeding.py).
            workers = loader_kwargs.get("num_workers", 0) > 0
            samples = KeyedSamples(dataset) if workers else dataset
            super().__init__(samples, batch_sampler=sampler.batches(keyed=workers),
                             collate_fn=EmptySafeCollate(collate_fn, dataset), **loader_kwargs)
            # DataLoader fills `sampler` with a placeholder when given a batch sampler; expose
            # ours instead, so the familiar `loader.sampler.set_epoch(epoch)` works.
            object.__setattr__(self, "sampler", sampler)
            # and the user's dataset as `loader.dataset`: the workers get the keyed view of it
            # (`_get_iterator`)
            object.__setattr__(self, "dataset", dataset)
            self._worker_samples = samples if workers else None
            self.distributed_sampler = sampler
        self.shuffle, self.seed = shuffle, seed
        self.device = torch.device(device) if device is not None else None
        self.drop_last_step = drop_last  # True: the incomplete last global batch is left out
        self._stream_taken = 0  # a stream's batches the loop has taken in the pass in progress

    def _get_iterator(self):
        """DataLoader's iterator (its workers started with the dataset they fetch from): the
        keyed samples, where workers make them (see `__init__`)."""
        samples = getattr(self, "_worker_samples", None)
        if samples is None:
            return super()._get_iterator()
        user = self.dataset
        object.__setattr__(self, "dataset", samples)
        try:
            return super()._get_iterator()
        finally:
            object.__setattr__(self, "dataset", user)

    def batches_left(self) -> int:
        """Batches this rank has still to take in the epoch in progress, the same on every
        rank: `len(loader)` before the epoch begins, fewer after `px.load` restored the sampler
        mid-epoch, or as the loop takes them. `len(loader)` itself is always the whole epoch's
        batches per rank, as for a torch DataLoader (see [Note: an epoch's length and what is
        left of it] in sampler.py)."""
        if self.distributed_sampler is not None:
            return self.distributed_sampler.batches_left()
        return len(self) - self._stream_taken

    def __iter__(self):
        sampler, device = self.distributed_sampler, self.device
        if sampler is not None:
            sampler.restart = False
            sampler.replay.loop_pass_begins()  # no gather of this pass yet (continuing/gathers.py)
            epoch = sampler.replay.loop_epoch()  # where this pass must end: [Note: a step redone]
        self._stream_taken = 0
        batches = super().__iter__()
        while True:
            began = time.perf_counter()  # the wait for the batch: the step report's data_s
            continuation.now().iteration_starts(batch=True)
            if sampler is not None and sampler.restart:  # see [Note: a step redone] in replay.py
                sampler.restart = False
                batches = super().__iter__()
            try:
                batch = next(batches)
            except StopIteration:
                if sampler is not None and sampler.replay.catching_up():  # [Note: a step redone]
                    sampler._pass_finished()  # a replayed epoch ended: on with the next one
                    batches = super().__iter__()
                    continue
                break
            if device is not None:  # in this process: loader workers never touch the GPU
                batch = to_device(batch, device)
            add_data_wait(time.perf_counter() - began)
            if sampler is not None:
                sampler._batch_consumed()
            else:
                self._stream_taken += 1
            yield batch
        self._stream_taken = 0
        if sampler is not None:
            sampler.replay.loop_pass_ends(epoch)
            sampler._pass_finished()
            # its ledger must balance: [Note: the ledger] in ledger.py
            continuation.now().pass_ended(sampler.replay)


# -- empty batches ---------------------------------------------------------------------------

class _EmptyBatch:
    """What the stream yields for a rank with no share of a step: a sample to take the shape of."""

    def __init__(self, template):
        self.template = template


class EmptySafeCollate:
    """Wraps a collate function so an empty batch becomes zero rows of an ordinary batch.

    The template sample is the dataset's first (map-style) or one from the same step (stream).
    """

    def __init__(self, collate_fn, dataset=None):
        self.collate_fn = collate_fn
        self.dataset = dataset

    def __call__(self, batch):
        if isinstance(batch, _EmptyBatch):
            return zero_rows(self.collate_fn([batch.template]))
        if len(batch) == 0 and self.dataset is not None:
            return zero_rows(self.collate_fn([self.dataset[0]]))
        return self.collate_fn(batch)


def _is_leaf(x) -> bool:
    return not isinstance(x, (torch.Tensor, abc.Mapping)) and (
        isinstance(x, (str, bytes)) or not isinstance(x, abc.Sequence))


def zero_rows(collated):
    """The same structure as a collated batch of one sample, with zero samples in it."""
    if isinstance(collated, torch.Tensor):
        return collated[:0] if collated.dim() > 0 else collated
    if hasattr(collated, "shape") and hasattr(collated, "__getitem__") and collated.shape:
        return collated[:0]  # numpy arrays and the like
    if isinstance(collated, abc.Mapping):
        return type(collated)({k: zero_rows(v) for k, v in collated.items()})
    if isinstance(collated, tuple) and hasattr(collated, "_fields"):
        return type(collated)(*(zero_rows(v) for v in collated))
    if isinstance(collated, (list, tuple)):
        if collated and all(_is_leaf(v) for v in collated):
            return type(collated)()  # a per-sample list (strings, numbers): no samples
        return type(collated)(zero_rows(v) for v in collated)
    return collated


# -- iterable datasets -----------------------------------------------------------------------

class RankSplitStream(IterableDataset):
    """One rank's (and one loader worker's) part of a stream, as lists of samples per step.

    See the module docstring: cut into global batches, slice r per rank, steps dealt to
    workers in turn (the DataLoader collects workers' batches in turn, which restores the order).
    """

    def __init__(self, dataset, batch_size: int, drop_last: bool, rank: int, world_size: int):
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.rank, self.world_size = rank, world_size

    def __len__(self) -> int:
        n = len(self.dataset)  # TypeError when the stream has no length, as DataLoader expects
        g = self.batch_size * self.world_size
        return n // g if self.drop_last else -(-n // g)

    def _share(self, step_items):
        lo, hi = split_evenly(len(step_items), self.world_size, self.rank)
        return step_items[lo:hi] if hi > lo else _EmptyBatch(step_items[0])

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        global_batch = self.batch_size * self.world_size
        step, items = 0, []
        for item in self.dataset:
            items.append(item)
            if len(items) == global_batch:
                if step % workers == worker:
                    yield self._share(items)
                step, items = step + 1, []
        if items and not self.drop_last and step % workers == worker:
            yield self._share(items)
