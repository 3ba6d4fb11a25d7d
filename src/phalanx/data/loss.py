"""`px.global_mean`: a loss normalised by the element count of the whole optimizer step.

When batches hold different numbers of elements (tokens of variable-length sequences, masked
positions), "the mean loss" is ambiguous. Averaging each rank's mean, or each micro-step's,
weights an element of a short batch more than one of a long batch, so the gradient changes with
the number of ranks and of accumulation micro-steps. The single-process reference is the mean
over ALL elements of the global batch:

    L = (sum of every element's loss, over all ranks and micro-steps) / (their total count)

Data-parallel gradients are the MEAN over ranks (phalanx divides the summed gradient by the
world size), and micro-step gradients add up. So each rank backpropagates, per micro-step,

    loss_sum * world_size / total_count

and the averaged, accumulated gradient is exactly dL/dθ. `total_count` needs the count of
every micro-step of the step before the first backward, so count the step's elements first:

    micro_batches = [next(batches) for _ in range(accumulation)]
    count = torch.tensor(sum(int((b["labels"] != -100).sum()) for b in micro_batches))
    for i, b in enumerate(micro_batches):
        sync = contextlib.nullcontext() if i == accumulation - 1 else px.no_sync(model)
        with sync:
            token_losses = F.cross_entropy(model(b["input"]).flatten(0, 1),
                                           b["labels"].flatten(), reduction="sum",
                                           ignore_index=-100)
            px.global_mean(token_losses, count).backward()
    optimizer.step(); optimizer.zero_grad()

The global total is one all-reduce of a single number. When `count` is a tensor, the total is
remembered on that tensor object, so passing the same tensor to every micro-step of a step
costs one all-reduce per step (a tensor changed in place is reduced again); a Python number
is reduced on every call. Every rank must call `global_mean` the same number of times.
For logging, the mean over ranks of the per-step sum of the returned values is L itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import runtime
from .gather import comm_device

__all__ = ["global_mean"]

_CACHE_ATTR = "_phalanx_global_count"


def global_mean(loss_sum: torch.Tensor, count) -> torch.Tensor:
    """`loss_sum * world_size / (count summed over ranks)`: see the module notes.

    `loss_sum`: this micro-step's summed (not averaged) loss on this rank.
    `count`: this rank's number of elements in the whole optimizer step (all micro-steps),
    an int, float or tensor (a weighted loss may pass its summed weights).
    A step with no elements at all gives zero rather than NaN.
    """
    if not isinstance(loss_sum, torch.Tensor):
        raise TypeError(f"px.global_mean: loss_sum must be a tensor, got {type(loss_sum).__name__}")
    group = runtime.default_group()
    world = 1 if group is None else dist.get_world_size(group)
    total = _global_total(count, group)
    scale = torch.where(total > 0, world / total, torch.zeros_like(total))
    return loss_sum * scale.to(loss_sum.device, loss_sum.dtype)


def _global_total(count, group) -> torch.Tensor:
    """The sum of `count` over ranks as a float64 tensor, cached on a tensor `count`."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(f"px.global_mean: count must hold one number, got shape "
                             f"{tuple(count.shape)}; pass count.sum()")
        cached = getattr(count, _CACHE_ATTR, None)
        if cached is not None and cached[0] == count._version:
            return cached[1]
        local = count.detach().reshape(()).to(torch.float64)
    elif isinstance(count, (int, float)) and not isinstance(count, bool):
        local = torch.tensor(float(count), dtype=torch.float64)
    else:
        raise TypeError(f"px.global_mean: count must be a number or a one-element tensor, "
                        f"got {type(count).__name__}")
    if group is not None:
        local = local.to(comm_device(group)).clone()
        dist.all_reduce(local, group=group)
    if isinstance(count, torch.Tensor):
        setattr(count, _CACHE_ATTR, (count._version, local))
    return local
