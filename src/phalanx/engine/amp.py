"""torch.amp's GradScaler on a prepared model and optimizer: the script's own loss scaling.

[Note: torch.amp's GradScaler on a prepared model]
A loop written for torch DDP's AMP,

    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                     # optional, to clip the true gradients
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)                         # skipped when some gradient is inf or NaN
    scaler.update()

works on a prepared model under every strategy, with the steps torch DDP skips skipped on
every rank. GradScaler looks for the gradients in `optimizer.param_groups`, checks them for
inf/NaN and divides them by the scale in place (`_unscale_grads_`); `step` runs the optimizer
only where that check found nothing, and `update` moves the scale from the same finding. An
adopted optimizer (optim.py) steps master pieces whose `.grad` exists only inside the step, and
under zero2 and zero3 the model's parameters have no `.grad` either (the reduced gradients live
in the engine's shards), so GradScaler found nothing to check ("No inf checks were recorded for
this optimizer"); and where gradients are sharded, what a rank holds is its shard only, so its
finding is its own.

So while a model is prepared, GradScaler's `_unscale_grads_` hands an adopted optimizer's
gradients to its engine (`unscale_units`), every other optimizer's to torch's own code:
  - the engine checks and unscales, in place, exactly what the step will apply and what `.grad`
    shows: each unit's owned reduced gradient where gradients are sharded (zero2, zero3), the
    whole reduced bucket where they are full (ddp, zero1: the model's `.grad` are views of it,
    so torch's clip over `model.parameters()` sees unscaled gradients), in the dtype they are
    held in (no master-dtype copy of every gradient at once: the step makes those a few units
    at a time, as always);
  - where each rank checked only its shard, one MAX all-reduce of the found-inf flag makes the
    finding every rank's, in the very tensor GradScaler keeps, so `step` skips on every rank
    alike and `update` moves every rank's scale alike.
Considered instead: giving the masters a `.grad` after backward, views of the reduced shards, so
GradScaler's own loop finds them. It needs the master dtype to be the gradients' dtype (under
bf16 it is not: a copy of every gradient would be kept), leaves the ranks' findings apart all
the same, and under zero1 would unscale only the owned slice of the full gradients `.grad`
shows. The scale is a power of two (GradScaler's default growth and backoff), so unscaling a
bf16 gradient in place is exact.

GradScaler scales the loss, so the gradient reaching the model's outputs is scaled too, and an
overflow there (fp16 outputs under autocast, a scale grown too large) is the scaler's to skip,
as under torch DDP, not a diverged loss: while a GradScaler scales losses in this process the
engine leaves such a step to it rather than raising `NonFiniteError` (faults/nonfinite.py).

A step voted down ([Note: the step vote] in vote.py) has no gradient on any rank: the check
finds no inf and makes no collective, so `step` (which then changes nothing) and `update` go
alike on every rank that calls them.

Refused, on every rank alike: precision="fp16" (phalanx scales the loss itself, and a second
scaler would scale it twice: use one of them) and staleness=1 (the gradient applied was scaled
by the previous step's scale).
"""

from __future__ import annotations

import weakref

import torch

from ..world import runtime
from .optim import adapter_of

__all__ = ["route_grad_scaler", "restore_grad_scaler", "scaler_in_use", "unscale_units"]

_ORIGINAL: dict = {}  # GradScaler's own methods while ours are installed
_SCALING = weakref.WeakSet()  # GradScalers that scaled a loss in this process


def scaler_in_use() -> bool:
    """Whether an enabled torch.amp GradScaler has scaled a loss in this process (and is
    alive): a non-finite gradient at the outputs is then its to skip (see the Note)."""
    return len(_SCALING) > 0


@torch.no_grad()
def unscale_units(engine, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                  allow_fp16: bool) -> dict:
    """GradScaler's check and unscale of `engine`'s reduced gradients (see the Note): returns
    {device: found_inf}, the flag agreed by every rank."""
    if engine.loss_scaler is not None:
        raise ValueError(
            "torch.amp.GradScaler on a model prepared with precision='fp16', which scales the "
            "loss itself: the gradients would be scaled twice. Use one of them: drop the "
            "GradScaler (and the autocast) and keep precision='fp16', or keep them and prepare "
            "with precision='fp32'")
    if engine.delayed is not None:
        raise ValueError(
            "torch.amp.GradScaler with staleness=1: the gradient a step applies was scaled by "
            "the previous step's loss scale and would be unscaled by this one's; use "
            "staleness=0, or precision='bf16' without a GradScaler")
    units = [u for u in engine.units if u.reduced is not None]
    grads = [u.reduced if engine.shard_grads else u.bucket.grads() for u in units]
    device = grads[0].device if grads else found_inf.device
    flag = found_inf.to(device)  # found_inf itself where it is on the gradients' device
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        if g.dtype == torch.float16 and not allow_fp16:
            raise ValueError("Attempting to unscale FP16 gradients.")  # torch's own refusal
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same, flag, inv_scale.to(device))
    if engine.shard_grads:  # each rank checked its own shard: agree
        engine.comm.all_reduce(flag, op="max", tag="amp:found_inf")
    return {device: flag}


def _unscale_grads_(scaler, optimizer, inv_scale, found_inf, allow_fp16):
    adapter = adapter_of(optimizer)
    if adapter is not None:  # a step voted down has no gradient anywhere (vote.py): no inf
        adapter.engine.vote.catch_up()
        if adapter.engine.vote.dropped:
            return {found_inf.device: found_inf}
    if adapter is None or not adapter.adopted:
        return _ORIGINAL["unscale"](scaler, optimizer, inv_scale, found_inf, allow_fp16)
    return unscale_units(adapter.engine, inv_scale, found_inf, allow_fp16)


def _scale(scaler, outputs):
    if scaler.is_enabled():
        _SCALING.add(scaler)
    return _ORIGINAL["scale"](scaler, outputs)


def route_grad_scaler() -> None:
    """Install the routing of the Note (once; every engine with an optimizer calls it)."""
    if _ORIGINAL:
        return
    cls = torch.amp.GradScaler
    _ORIGINAL.update(unscale=cls._unscale_grads_, scale=cls.scale)
    _unscale_grads_.__doc__ = cls._unscale_grads_.__doc__
    _scale.__doc__ = cls.scale.__doc__
    cls._unscale_grads_ = _unscale_grads_
    cls.scale = _scale


def restore_grad_scaler() -> None:
    """Give GradScaler its own methods back (px.shutdown)."""
    if not _ORIGINAL:
        return
    cls = torch.amp.GradScaler
    cls._unscale_grads_ = _ORIGINAL.pop("unscale")
    cls.scale = _ORIGINAL.pop("scale")


runtime.before_shutdown(restore_grad_scaler)
