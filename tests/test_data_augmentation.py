"""Random augmentation in loader workers: a sample draws the same wherever it is made.

In a worker, each sample's generators (torch's, `random`, NumPy's) are seeded from the loader's
seed, the epoch and the sample's position in the epoch's global order (src/phalanx/data/
seeding.py's [Note: a sample's own generators]), so what a sample draws depends neither on the
worker that makes it, nor on the world size, nor on where the iterator was made. The resume
case (a save mid-epoch with 2 workers, bit for bit) is in test_checkpoint_resume.py.
"""

from __future__ import annotations

import torch
from resume_loops import Augmented, dataset

import phalanx as px
from phalanx.testing import run_ranks

GLOBAL_BATCH = 4


def _epochs(world: int, workers: int) -> list:
    """Two epochs of this rank's batches from px.data_loader over a dataset that augments."""
    loader = px.data_loader(Augmented(dataset()), GLOBAL_BATCH // world, seed=5,
                            num_workers=workers)
    out = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        out.append([x.clone() for x, _ in loader])
    return out


def test_each_sample_is_augmented_alike_at_any_world_size_and_number_of_workers():
    """One process with 2 workers, and 2 ranks with 1 worker each: the global batches hold
    the same augmented values, bit for bit, in both epochs; and the epochs differ."""
    alone = _epochs(1, 2)
    ranks = run_ranks(_epochs, 2, args=(2, 1), timeout=120)
    for epoch in range(2):
        for step, whole in enumerate(alone[epoch]):
            parts = torch.cat([ranks[r][epoch][step] for r in range(2)])
            assert torch.equal(parts, whole), f"epoch {epoch}, step {step}"
    assert not torch.equal(alone[0][0], alone[1][0])
