"""`px.PowerSGD`: what a user asks for when gradients should cross the link as low-rank factors,
and which strategies and precisions it combines with.

    model, optimizer = px.prepare(model, optimizer, strategy="ddp",
                                  compression=px.PowerSGD(rank=4, start_step=10))

The algorithm and its state are in powersgd.py; this module only holds the request and its
checks, so that a bad one fails on every rank inside `px.prepare` before any collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PowerSGD"]


@dataclass(frozen=True)
class PowerSGD:
    """Low-rank gradient compression with error feedback and warm start (PowerSGD: Vogels,
    Karimireddy and Jaggi, NeurIPS 2019, arXiv:1905.13727), for ddp, zero1 and zero2.

    Each gradient of two or more dimensions, seen as a matrix of `shape[0]` rows, is sent as
    two thin factors P (rows x r) and Q (columns x r) in two all-reduces per bucket instead of
    the whole matrix; vectors (biases, norms) and matrices that would not shrink enough travel
    whole in the first of the two. The mean gradient the optimizer then sees is the low-rank
    approximation P Q^T of the mean over ranks. What the approximation leaves out is kept on
    each rank (error feedback) and added to the next step's gradient, so over many steps the
    applied updates add up to the true gradients.

    Args:
        rank: the number of columns r of the factors; a matrix of n rows and m columns uses
            min(rank, n, m). The paper's convolutional and recurrent networks kept their
            accuracy at 1 to 4; a small GPT trained with AdamW needed 32 to end within 1% of
            ddp's loss (docs/benchmarks.md, "Slow links: the losses over longer runs").
        start_step: how many gradient reductions (one per optimizer step in an ordinary loop,
            accumulation under `px.no_sync` included) go uncompressed first, bit for bit as
            without compression. The count is saved by `px.save`.
        min_compression: a matrix is compressed only if its factors take at most 1 /
            min_compression of its elements (n*m >= min_compression * (n+m) * r); 0 compresses
            every matrix, even at full rank.
        error_feedback: keep what each step's approximation left out and add it to the next
            step's gradient (one buffer the size of each compressed gradient on every rank).
        warm_start: start each step's power iteration from the previous step's Q instead of a
            fresh random one.
    """

    rank: int = 4
    start_step: int = 10
    min_compression: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True

    def __post_init__(self):
        if not _whole(self.rank) or self.rank < 1:
            raise ValueError(f"PowerSGD(rank={self.rank!r}): the rank of the factors is a whole "
                             "number of 1 or more (1 to 4 is usual)")
        if not _whole(self.start_step) or self.start_step < 0:
            raise ValueError(f"PowerSGD(start_step={self.start_step!r}): the number of gradient "
                             "reductions to run uncompressed first, a whole number of 0 or more")
        value = self.min_compression
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"PowerSGD(min_compression={value!r}): the least compression a "
                             "matrix must reach to be compressed, a finite number of 0 or more "
                             "(default 2.0)")
        for name in ("error_feedback", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PowerSGD({name}={getattr(self, name)!r}): True or False")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
