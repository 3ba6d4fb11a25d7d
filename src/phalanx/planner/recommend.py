"""The recommendation: the cheapest strategy that fits, and why; or what would make one fit."""

from __future__ import annotations

from .sizes import format_bytes

__all__ = ["recommend"]


def recommend(plans, memory, headroom, units, world, zero3_total, activations, checkpointing,
              host_memory=None, gpus_per_node=1, per_param=None):
    """(strategy or None, reason). `plans` are the StrategyPlans planned, in order ddp, zero1,
    zero2, zero3 (under offload, those offload is planned for); `zero3_total(n)` is zero3's
    peak per device at world size n. `host_memory`: bytes per node that offload's host side
    must fit in; `per_param`: what model states cost, said when nothing fits.

    The cheapest strategy is the one that fits with headroom and communicates least, the lower
    stage on a tie (each stage up adds latency to the step). With the engine's layout that is
    ddp when it fits, else zero2: zero1 keeps full gradients, so it all-reduces them and then
    gathers the update (3x the gradients' bytes where zero2 moves 2x), and zero2 also needs
    less memory; zero3 gathers the parameters again in backward (3x)."""
    limit = (1 - headroom) * memory
    host_limit = None if host_memory is None else (1 - headroom) * host_memory

    def on_host(p):
        return host_limit is None or p.host_bytes_per_node <= host_limit

    def short_of(names, said=False):
        """Why each of `names` does not fit: device memory, host memory or both (`said`: the
        limits are already in the sentence)."""
        device = [n for n in names if plans[n].total_bytes > limit]
        host = [n for n in names if not on_host(plans[n])]
        parts = []
        if device:
            parts.append(", ".join(f"{n} needs {format_bytes(plans[n].total_bytes, units)}"
                                   for n in device)
                         + (" per device" if said else
                            f", more than {1 - headroom:.0%} of {format_bytes(memory, units)}"))
        if host:
            parts.append(", ".join(f"{n} needs "
                                   f"{format_bytes(plans[n].host_bytes_per_node, units)}"
                                   for n in host)
                         + " of host memory per node" + ("" if said else
                                                         f", more than {1 - headroom:.0%} of "
                                                         f"{format_bytes(host_memory, units)}"))
        return "; ".join(parts)

    fitting = [n for n, p in plans.items() if p.fits_with_headroom]
    if fitting:
        order = list(plans)
        best = min(fitting, key=lambda n: (plans[n].comm_bytes_per_step, order.index(n)))
        p = plans[best]
        too_big = [n for n in order[:order.index(best)] if not plans[n].fits_with_headroom]
        reason = short_of(too_big) + "; " if too_big else ""
        reason += (f"{best} needs {format_bytes(p.total_bytes, units)} per device "
                   f"({p.total_bytes / memory:.0%} of memory) and, of the strategies that fit "
                   f"with {headroom:.0%} headroom, communicates least "
                   f"({format_bytes(p.comm_bytes_per_step, units)} per device per step)")
        return best, reason
    reason = (f"no strategy fits in {format_bytes(limit, units)} ({1 - headroom:.0%} of "
              f"{format_bytes(memory, units)}) per device"
              + (f" and {format_bytes(host_limit, units)} of host memory per node"
                 if host_limit is not None else "") + ": " + short_of(list(plans), said=True))
    if per_param:
        reason += f" (model states: {per_param}; only zero3 shards the weights)"
    short_of_host = any(not on_host(p) for p in plans.values())
    need = None if short_of_host else _gpus_for_zero3(zero3_total, world, limit)
    if need is not None:
        reason += f"; zero3 would fit on {need} devices"
    elif activations > limit / 2:
        reason += "; activations alone are too large"
    if activations > limit / 4:
        reason += ("; turn on activation checkpointing or lower the micro-batch"
                   if not checkpointing else "; lower the micro-batch or sequence length")
    return None, reason


def _gpus_for_zero3(zero3_total, world, limit):
    """The smallest world size above `world` at which zero3 fits in `limit`, or None.
    `zero3_total(n)` is zero3's bytes per device at world size n, non-increasing in n."""
    hi = world + 1
    while zero3_total(hi) > limit:
        if hi > 10**6:
            return None
        hi *= 2
    lo = max(world, hi // 2)  # zero3_total(lo) > limit, or lo == world
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if zero3_total(mid) <= limit else (mid, hi)
    return hi
