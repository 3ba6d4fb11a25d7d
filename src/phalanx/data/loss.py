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

The global total is one all-reduce of a single number, through the job's default `Comm`
(tagged "global_mean"). When `count` is a tensor, the total is remembered for that tensor object
(in a table of this module that holds it weakly, so nothing is written on the user's tensor and
nothing keeps it alive): passing the same tensor to every micro-step of a step costs one
all-reduce per step (a tensor changed in place is reduced again); a Python number is reduced on
every call. Every rank must call `global_mean` the same number of times.
For logging, the mean over ranks of the per-step sum of the returned values is L itself.
"""

from __future__ import annotations

import torch

from ..comm.collectives import Comm
from ..world.process import state
from ..world.runtime import default_comm

__all__ = ["global_mean"]

# state.loss_totals (process.py): count tensor (by identity, held weakly) -> (its _version, the
# Comm, the reduced total). An entry goes when its tensor dies; a hit needs the same live object,
# unchanged, and the same Comm.


def global_mean(loss_sum: torch.Tensor, count) -> torch.Tensor:
    """`loss_sum * world_size / (count summed over ranks)`: the loss to backpropagate so that
    the averaged, accumulated gradient is that of the mean over every element of the global
    batch, as one process would compute it, whatever the ranks' and micro-steps' counts.

    `loss_sum`: this micro-step's summed (not averaged) loss on this rank.
    `count`: this rank's number of elements in the whole optimizer step (all micro-steps),
    an int, float or tensor (a weighted loss may pass its summed weights); count the step's
    elements before its first backward. The total over ranks is one all-reduce of a single
    number, made once per step when the same tensor is passed to every micro-step (a Python
    number is reduced on every call). Every rank must call it the same number of times.
    A step with no elements at all gives zero rather than NaN.

        count = torch.tensor(sum(int((b["labels"] != -100).sum()) for b in micro_batches))
        for i, b in enumerate(micro_batches):
            with px.no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext():
                losses = F.cross_entropy(model(b["input"]).flatten(0, 1), b["labels"].flatten(),
                                         reduction="sum", ignore_index=-100)
                px.global_mean(losses, count).backward()
    """
    if not isinstance(loss_sum, torch.Tensor):
        raise TypeError(f"px.global_mean: loss_sum must be a tensor, got {type(loss_sum).__name__}")
    comm = default_comm()
    total = _global_total(count, comm)
    scale = torch.where(total > 0, comm.world / total, torch.zeros_like(total))
    return loss_sum * scale.to(loss_sum.device, loss_sum.dtype)


def _global_total(count, comm: Comm) -> torch.Tensor:
    """The sum of `count` over ranks as a float64 tensor, remembered for a tensor `count`."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(f"px.global_mean: count must hold one number, got shape "
                             f"{tuple(count.shape)}; pass count.sum()")
        cached = state.loss_totals.get(count)
        if cached is not None and cached[0] == count._version and cached[1] is comm:
            return cached[2]
        local = count.detach().reshape(()).to(torch.float64)
    elif isinstance(count, (int, float)) and not isinstance(count, bool):
        local = torch.tensor(float(count), dtype=torch.float64)
    else:
        raise TypeError(f"px.global_mean: count must be a number or a one-element tensor, "
                        f"got {type(count).__name__}")
    if comm.group is not None:
        local = local.to(comm.device).clone()
        comm.all_reduce(local, op="sum", tag="global_mean")
    if isinstance(count, torch.Tensor):
        state.loss_totals[count] = (count._version, comm, local)
    return local
