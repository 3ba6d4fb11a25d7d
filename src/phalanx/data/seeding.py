"""Randomness in loader workers: each sample's draws keyed by its place in the epoch.

[Note: a sample's own generators]
Random augmentation (torchvision's transforms, albumentations, a dataset's own `torch.rand`)
runs in the loader's worker processes, and draws from each worker's generators: torch's, whose
seed a DataLoader draws from the main process at every iterator it makes, Python's `random`
and NumPy's, which torch seeds from it. A worker's generators then advance with every sample it
makes. A run resumed in the middle of an epoch makes its iterator at another point of the
pass: other base seeds, other workers holding other batches, so other augmentations from the
resumed batch on (3.3e-3 off the uninterrupted run with 2 workers; Accelerate #4195 and #4233
are this family). With no workers the draws come from the main process's generators, which a
checkpoint restores (sampler.py's [Note: a pass continued]).

So in a worker each sample is made with its own generators: before `dataset[i]`, torch's CPU
generator, Python's `random` and NumPy's global state are seeded from the loader's `seed`, the
epoch, and the sample's position in the epoch's global order (`sample_seed`). What a sample
draws no longer depends on which worker makes it, on what that worker made before, or on when
the iterator was made: a resumed run draws, for every sample it has still to see, what the
uninterrupted run drew. The position is the global order's, not this rank's, so the same holds
at another world size and another number of workers: a sample is augmented alike wherever it
is made. (The keys are `seed`'s: `px.data_loader(..., seed=)` chooses the order and the
augmentations together; a script's `torch.manual_seed` no longer changes what the workers
draw. A `worker_init_fn`'s seeding is overridden sample by sample.)

Seeding costs about 8 us a sample (torch's CPU generator alone, not `torch.manual_seed`, which
also visits every accelerator's: 75 us here). The main process (`num_workers=0`) is left as it
was: its generators are the script's, restored by `px.load`.
"""

from __future__ import annotations

import random

import torch

__all__ = ["KeyedSamples", "sample_seed"]

_MASK64 = (1 << 64) - 1
_SALT = 0x5DEECE66D  # keeps a sample's key apart from the epoch's order seed (sampler.py)


def _mix(x: int) -> int:
    """splitmix64's finaliser: a 64-bit value whose bits all depend on every bit of `x`."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """The 63-bit seed of the sample at `position` of epoch `epoch`'s global order."""
    x = _mix(seed * 0x9E3779B97F4A7C15 + _SALT)
    x = _mix(x + epoch * 0xD1B54A32D192ED03)
    return _mix(x + position) >> 1


def seed_here(key: int) -> None:
    """Seed this process's torch CPU generator, `random` and NumPy's global state from `key`."""
    torch.default_generator.manual_seed(key)
    random.seed(key)
    try:
        import numpy
    except ImportError:  # NumPy is not required by torch
        return
    numpy.random.seed(key & 0xFFFFFFFF)


class KeyedSamples(torch.utils.data.Dataset):
    """The dataset as a loader's workers see it: `self[(index, key)]` seeds the worker's
    generators from `key` and returns `dataset[index]` (see the Note)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item):
        index, key = item
        seed_here(key)
        return self.dataset[index]
