"""Data for data parallelism: sampler, loader, gathering and exact evaluation, batch inference.

- `sampler`: one global order per epoch, split across ranks batch by batch; resumable at any
  world size (`DistributedSampler`); `replay`: its part in steps redone after a rank is lost.
- `loader`: `data_loader`, a DataLoader over that sampler (or over a stream split by rank).
- `gathering`: every rank's value in rank order (`gather`).
- `evaluation`: outputs of the whole dataset, each sample once (`gather_for_metrics`).
- `inference`: data-parallel batch inference (`map_batches`).
- `loss`: loss normalised by the global element count of a step (`global_mean`).
"""

from .evaluation import gather_for_metrics
from .gathering import gather
from .inference import map_batches
from .loader import data_loader
from .loss import global_mean
from .sampler import DistributedSampler

__all__ = ["DistributedSampler", "data_loader", "gather", "gather_for_metrics", "map_batches",
           "global_mean"]
