"""The sampler: one global order per epoch, cut into global batches, each split across ranks.

[Note: one global order]
Each epoch has a single permutation of the dataset that depends on the seed and the epoch only,
never on the world size. The order is cut into global batches of `world_size * batch_size`
samples, and each global batch is split across ranks in rank order: rank r takes the r-th
contiguous slice. Two things follow by construction:

- with the same global batch, global step k holds the same samples at any world size, so
  1 rank with batch 12 and 3 ranks with batch 4 train on the same stream;
- how far an epoch has got is one number, the count of samples of the global order already
  consumed. A state saved at one world size therefore resumes at any other with exactly the
  samples not yet seen (from there on, the new global batch cuts the rest of the order).

[Note: the tail of an epoch]
With `drop_last=False` the last global batch may hold fewer samples `m` than `world_size *
batch_size`. It is split as evenly as possible, in rank order (rank r gets `m // world_size`
samples, plus one when `r < m % world_size`); no sample is repeated to fill it. Every rank
still has the same number of batches per epoch, so no rank waits in a collective for a rank
that has finished. When `m < world_size` some ranks' share of the last step is empty:
`px.data_loader` then hands those ranks an empty batch (zero rows, the structure of an ordinary
batch), which contributes nothing to a sum and nothing to `px.global_mean`. With
`drop_last=True` the incomplete last global batch is left out on every rank.

A plain `torch.utils.data.DataLoader(dataset, batch_size=B, sampler=sampler)` also works: the
sampler then yields this rank's indices one by one and, with the default `batch_size=1`, rank r
gets the samples r, r + W, r + 2W, ... of the global order, so each loader step still covers
the same W * B samples of the order at any world size. Such a loader cannot produce empty
batches, so with `drop_last=False` and a dataset length that does not divide evenly, ranks can
end an epoch one batch apart; use `px.data_loader` (or `drop_last=True`) when every rank must
take the same number of steps.

[Note: counting consumed samples]
The state records samples that reached the training loop, not indices handed to the loader:
with `num_workers > 0` the loader fetches indices several batches ahead. `px.data_loader`
reports each batch as it is yielded (`_batch_consumed`) and the end of a full pass
(`_pass_finished`). Iterated on its own, the sampler counts the indices it yields, which is
exact for a loader without workers and runs ahead by the prefetch with them.

[Note: an epoch's length and what is left of it]
`len(sampler)` is the indices this rank takes in a whole epoch and `len(loader)` the batches
per rank in a whole epoch, as for PyTorch's sampler and DataLoader, before and after a resume:
a script that computes its epoch from a step count (`step // len(loader)`, as Accelerate's
examples do) finds the right one. What is left of the epoch in progress has names of its own:
`sampler.samples_left()`, `sampler.batches_left()` and `loader.batches_left()`, which after
`px.load` mid-epoch count only the batches the resumed pass will yield. (A replay under
`phalanx run --on-failure continue` that leaves a lost batch out makes that epoch one batch
shorter than `len(loader)`; `batches_left()` counts it.)

A complete pass advances the epoch by itself, so forgetting `set_epoch` does not replay the
same order every epoch; calling `set_epoch(e)` before each epoch, as with PyTorch's sampler,
gives the same result.
"""

from __future__ import annotations

import numbers

import torch
from torch.utils.data import Sampler

from ..world import runtime
from .replay import Replay
from .seeding import sample_seed

__all__ = ["DistributedSampler", "split_evenly", "check_batch_size"]

_MASK64 = (1 << 64) - 1
_STATE_VERSION = 1


def check_batch_size(batch_size, name: str = "batch_size") -> int:
    """Return `batch_size` if it is a positive int, else raise an error that says so."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{name} must be a positive integer (samples per rank), got "
                         f"{batch_size!r}; pass e.g. {name}=8")
    return batch_size


def split_evenly(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """The [lo, hi) slice of `size` items that `rank` takes when they are shared in rank order.

    Shares differ by at most one, earlier ranks taking the extra ones; a full global batch of
    `world_size * b` items gives every rank exactly `b` consecutive items.
    """
    q, rem = divmod(size, world_size)
    lo = rank * q + min(rank, rem)
    return lo, lo + q + (1 if rank < rem else 0)


def _epoch_seed(seed: int, epoch: int) -> int:
    """Mix seed and epoch into one 63-bit generator seed (splitmix64 finaliser).

    A plain `seed + epoch` would make (seed 0, epoch 1) and (seed 1, epoch 0) the same order.
    """
    x = (seed * 0x9E3779B97F4A7C15 + epoch + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class DistributedSampler(Sampler[int]):
    """This rank's part of one order per epoch, the same at every world size.

        sampler = px.DistributedSampler(dataset, shuffle=True, seed=0, drop_last=False)
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
        # or, with equal step counts on every rank guaranteed: px.data_loader(dataset, 32)

    `batch_size` (keyword, default 1) is the per-rank batch that splits each global batch; the
    loader made by `px.data_loader` sets it. `rank` and `world_size` default to the job's.

    Each epoch's permutation depends on `seed` and the epoch only. It is cut into global
    batches of `world_size * batch_size` samples, and rank r takes the r-th contiguous slice of
    each: with the same global batch, step k holds the same samples at any world size, and a
    `state_dict()` saved at one world size resumes at another with exactly the samples not
    yet seen. With `drop_last=False` the last global batch is split as evenly as possible in
    rank order, no sample repeated (`px.data_loader` gives a rank left with none an empty
    batch, so every rank takes the same number of steps); with `drop_last=True` it is left
    out. `len(sampler)` is this rank's indices in a whole epoch, before and after a resume. A
    complete pass advances the epoch by itself; `set_epoch(e)` before each epoch, as with
    PyTorch's sampler, gives the same order.
    """
    # The rules in full: the Notes at the top of this module.

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 batch_size: int = 1, rank: int | None = None, world_size: int | None = None):
        try:
            self.dataset_length = len(dataset)
        except TypeError:
            raise TypeError(
                f"DistributedSampler needs a dataset with a length (map-style), got "
                f"{type(dataset).__name__}; for an IterableDataset use px.data_loader, which "
                f"splits the stream across ranks itself") from None
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {seed!r}")
        seed = int(seed)
        self.batch_size = check_batch_size(batch_size)
        self._world = None if world_size is None else int(world_size)
        self._rank = None if rank is None else int(rank)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        # One global batch for the sampler's life: after a rank is lost under `phalanx run
        # --on-failure continue`, the survivors split the same global batches among fewer
        # ranks (see [Note: a step redone] in replay.py).
        self._global_batch = self.world_size * self.batch_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._start = 0          # position in the global order where the next pass begins
        self._pass_start = 0     # ... where the pass in progress began
        self._steps_done = 0     # global steps of the pass in progress that reached the loop
        self._in_pass = False
        self.restart = False      # the loader must start its iteration again (a rewind)
        self._continuing = None   # (epoch, position, restore): see [Note: a pass continued]
        # What steps redone under continue mode need: where the last committed step left the
        # order, what a replay leaves out, an evaluation's gathers (see replay.py)
        self.replay = Replay(self)

    @property
    def world_size(self) -> int:
        """The ranks splitting each global batch: the job's, as it is now, unless given."""
        return runtime.world_size() if self._world is None else self._world

    @property
    def rank(self) -> int:
        return runtime.rank() if self._rank is None else self._rank

    @property
    def global_batch_size(self) -> int:
        return self._global_batch

    # -- the order -------------------------------------------------------------------------
    def global_order(self, epoch: int | None = None) -> torch.Tensor:
        """The epoch's order of dataset indices, the same on every rank and at any world size."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.dataset_length)
        g = torch.Generator()
        g.manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(self.dataset_length, generator=g)

    def _end(self, start: int) -> int:
        """Where a pass that begins at `start` stops (drop_last leaves out an incomplete step)."""
        n = self.dataset_length
        if self.drop_last:
            return start + (n - start) // self.global_batch_size * self.global_batch_size
        return n

    # -- lengths: the epoch's, and what is left of it -----------------------------------------
    def __len__(self) -> int:
        """Indices this rank takes in a whole epoch, as `len()` of PyTorch's sampler: the same
        before and after a resume. What is left of the epoch in progress: `samples_left()`."""
        return self._rank_share(self._end(0))

    def samples_left(self) -> int:
        """Indices this rank has still to take in the epoch the sampler is in: `len(sampler)`
        before the epoch begins, fewer after a resume mid-epoch or as the epoch is consumed."""
        return self._rank_share(self._left())

    def batches_left(self) -> int:
        """Batches (global steps) still to come in the epoch the sampler is in, the same on
        every rank: all of the epoch's before it begins, fewer after a resume mid-epoch or as
        the loop takes them. `len(loader)` stays the epoch's whole length."""
        return -(-self._left() // self.global_batch_size)

    def _epoch_steps(self) -> int:
        """Batches per rank in a whole epoch: `len(loader)`."""
        return -(-self._end(0) // self.global_batch_size)

    def _left(self) -> int:
        """Samples of the epoch's global order still to be consumed (by all ranks), less what
        a replay leaves out, and the whole of each epoch up to the loop's while a replay stands
        in an earlier one ([Note: a step redone] in replay.py)."""
        start = self._pass_start if self._in_pass else self._start
        end, pos = self._end(start), self.position()
        return max(0, end - pos - self.replay.skipped(pos, end)) + self.replay.left_to_catch_up()

    def _rank_share(self, samples: int) -> int:
        """This rank's part of `samples` consecutive samples of the order cut into global
        batches (see [Note: the tail of an epoch])."""
        full, tail = divmod(samples, self.global_batch_size)
        lo, hi = split_evenly(self.global_batch_size, self.world_size, self.rank)
        tail_lo, tail_hi = split_evenly(tail, self.world_size, self.rank)
        return full * (hi - lo) + tail_hi - tail_lo

    def _pass(self):
        """One pass from the current position: this rank's list of indices per global step.

        Starting the generator marks the beginning of a pass; the caller reports progress.
        """
        start, pos, epoch = self._start, self._start, self.epoch
        self._continue_pass()
        order = self.global_order()
        end = self._end(start)
        jumps = self.replay.jumps()
        self._pass_start, self._steps_done, self._in_pass = start, 0, True
        while pos < end:
            if pos in jumps:
                pos = jumps[pos]
                continue
            size = min(self.global_batch_size, end - pos)
            lo, hi = split_evenly(size, self.world_size, self.rank)
            self._yielding = (epoch, pos, size)  # for __iter__'s count (the loader is behind)
            yield order[pos + lo:pos + hi].tolist()
            pos += self.global_batch_size

    def __iter__(self):
        for batch in self._pass():
            self._batch_consumed(self._yielding)  # See [Note: counting consumed samples]
            yield from batch
        self._pass_finished()

    def batches(self, keyed: bool = False):
        """A batch sampler over this sampler: yields this rank's list of indices per step;
        `keyed`, of (index, the sample's seed) pairs: what `px.data_loader` hands its workers,
        which seed each sample's generators from its key."""
        # See [Note: a sample's own generators] in seeding.py
        return _BatchView(self, keyed)

    # -- progress, reported by the loader ---------------------------------------------------
    def _batch_consumed(self, at: tuple | None = None) -> None:
        """The loop is served the pass's batch `at` (epoch, position, size), by default the
        one after those it took."""
        if at is None and self.replay.ledger is not None:  # continue mode counts it (ledger.py)
            pos = self.position()
            at = (self.epoch, pos, min(self.global_batch_size, self._end(self._pass_start) - pos))
        self.replay.batch_consumed(at)  # See [Note: the ledger] in ledger.py
        self._steps_done += 1

    def _pass_finished(self) -> None:
        self.epoch += 1
        self._start = self._pass_start = self._steps_done = 0
        self._in_pass = False
        self.replay.next_epoch(self.epoch)  # a replay may have caught up with the loop's epoch

    def position(self) -> int:
        """Samples of the current epoch's global order consumed so far (by all ranks)."""
        if not self._in_pass:
            return self._start
        pos = self.replay.after_skips(self._pass_start,
                                      self._pass_start + self._steps_done * self.global_batch_size)
        return min(pos, self._end(self._pass_start))

    # -- epochs and state -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next pass follows.

        Setting the epoch the sampler is already in keeps its position, so the usual
        `set_epoch(epoch)` at the top of the epoch loop does not undo a resume; nor does
        setting the epoch that a recovery under `phalanx run --on-failure continue` is
        carrying the pass into.
        """
        # [Note: a step redone] in replay.py: the epoch a replay is on its way to
        epoch = int(epoch)
        if epoch != self.epoch and not self.replay.catching_up_to(epoch):
            self.epoch, self._start, self._in_pass = epoch, 0, False
            self._continuing = None
            self.replay.epoch_set(epoch)

    def state_dict(self) -> dict:
        """Epoch and samples consumed: enough to resume at the next sample at any world size.

        Needs no communication, so it may be called on one rank only.
        """
        consumed = self.position()
        state = {"version": _STATE_VERSION, "epoch": self.epoch, "consumed": consumed,
                 "dataset_length": self.dataset_length, "seed": self.seed,
                 "shuffle": self.shuffle, "drop_last": self.drop_last,
                 "global_batch_size": self.global_batch_size}
        state.update(self.replay.state(consumed))  # what a replay left out, the ledger (replay.py)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume where `state` was taken: the next pass starts at the next unseen sample."""
        missing = {"epoch", "consumed", "dataset_length", "seed", "shuffle"} - set(state)
        if missing:
            raise ValueError(f"not a DistributedSampler state: missing {sorted(missing)}")
        if state["dataset_length"] != self.dataset_length:
            raise ValueError(
                f"sampler state was saved for a dataset of {state['dataset_length']} samples, "
                f"but this sampler's dataset has {self.dataset_length}: load it into a sampler "
                f"over the same dataset (or start this dataset's sampler from scratch)")
        if state["seed"] != self.seed:
            raise ValueError(
                f"sampler state was saved with seed={state['seed']}, but this sampler has "
                f"seed={self.seed}: the orders differ, so build the sampler with "
                f"seed={state['seed']} to resume")
        if bool(state["shuffle"]) != self.shuffle:
            raise ValueError(
                f"sampler state was saved with shuffle={state['shuffle']}, but this sampler has "
                f"shuffle={self.shuffle}: build it with shuffle={state['shuffle']} to resume")
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.dataset_length:
            raise ValueError(f"sampler state has consumed={consumed}, outside the dataset's "
                             f"{self.dataset_length} samples")
        self.epoch, self._start = int(state["epoch"]), consumed
        self._pass_start, self._steps_done, self._in_pass = consumed, 0, False
        self.replay.load(state)
        self._continuing = None  # px.load sets it after restoring the generators
        self.restart = True  # a loader iterating now starts again from here

    # -- what its replay part reads and moves (replay.py) ------------------------------------
    def _pass_began(self) -> int | None:
        """Where the pass in progress began in the epoch's order; None between passes."""
        return self._pass_start if self._in_pass else None

    def _restart_at(self, epoch: int, start: int) -> None:
        """The next pass begins at `start` of `epoch`'s order, and the loader starts its
        iteration again: where a recovery sends the sampler ([Note: a step redone] in
        replay.py)."""
        self._continuing = None
        self.epoch, self._start = epoch, start
        self._pass_start, self._steps_done, self._in_pass = start, 0, False
        self.restart = True

    # -- a pass continued after a load ------------------------------------------------------
    def _on_continued_pass(self, restore) -> None:
        """[Note: a pass continued]
        A torch DataLoader draws from the global generator each time an iterator over it is
        made (its workers' base seed, `_BaseDataLoaderIter.__init__`, even with no workers).
        In an uninterrupted run that draw happens once per pass, before the pass's first batch.
        A run resumed from a checkpoint saved in the middle of a pass makes an iterator again
        to continue that pass: one draw the uninterrupted run never made, so after `px.load`
        restored the generators every dropout mask from there on came out shifted (a 2-rank
        run with Dropout(0.3) saved at batch 5 of 10 ended 0.88 from the uninterrupted run,
        tests/test_checkpoint_resume.py).

        So `px.load`, having restored this rank's generators with the saved sampler state,
        hands the sampler `restore` (which sets them to the saved states again); when the pass
        that continues the loaded position begins (after the iterator's draw, before its first
        index is fetched), the sampler calls it, and the loop's random numbers from the next
        batch on are the ones the uninterrupted run drew there. A loaded position at the start
        or end of an epoch begins a new pass, which draws as the uninterrupted run's did: then
        nothing is restored. Neither is it after `set_epoch` to another epoch or a replay."""
        start = self._start
        if 0 < start < self._end(start):
            self._continuing = (self.epoch, start, restore)

    def _continue_pass(self) -> None:
        """At the start of a pass: restore the generators if it continues a loaded pass."""
        continuing, self._continuing = self._continuing, None
        if continuing is not None and continuing[:2] == (self.epoch, self._start):
            continuing[2]()


class _BatchView(Sampler[list]):
    """The sampler seen as a batch sampler: the loader's `batch_sampler`.

    It does not count progress itself: the loader does, as batches reach the training loop.
    """

    def __init__(self, sampler: DistributedSampler, keyed: bool = False):
        self.sampler = sampler
        self.keyed = keyed

    def __iter__(self):
        sampler = self.sampler
        for batch in sampler._pass():
            if not self.keyed:
                yield batch
                continue
            epoch, pos, size = sampler._yielding  # this batch: its place in the global order
            lo, _ = split_evenly(size, sampler.world_size, sampler.rank)
            yield [(index, sample_seed(sampler.seed, epoch, pos + lo + j))
                   for j, index in enumerate(batch)]

    def __len__(self) -> int:
        return self.sampler._epoch_steps()  # the epoch's, as a DataLoader's len() is
