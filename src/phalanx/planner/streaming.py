"""Streaming DiLoCo over a link: which `fragments` and `delay` hide the outer exchange behind
the inner steps, for `phalanx plan --link` (link.py).

[Note: planning streaming DiLoCo]
Under `px.DiLoCo(sync_every=H, fragments=P, delay=D)` (engine/diloco.py) one fragment of the
model is sent every H/P steps and its average is applied D steps later, so the exchange is
hidden when it takes at most D steps of compute, and D must stay below H/P (one fragment in
flight at a time; model/diloco.py refuses otherwise). The planner sends it in 4 bits: each
rank all-gathers one payload of `quantized_bytes` (engine/diloco_wire.py: the values two to a
byte and one scale per 128 elements of each parameter, in the masters' dtype), so each rank
receives N-1 payloads, over a ring in N-1 hops that each pay the link's latency:

    t(P) = (N-1) (payload(P) / L + latency)       payload(P): the largest of the P fragments
    D(P) = max(1, ceil(t(P) / C))                  C: the compute of one optimizer step

The fragments are cut as the engine cuts them (`fragment_of` over the trainable parameters'
sizes, at most one fragment per parameter); from a bare count, as P equal tensors. Of the P
that divide H with D(P) < H/P, the plan takes the one with the smallest D (the fewest steps an
average is late by; with keep_local=0 the steps each fragment drops), the fewest fragments on a
tie (each exchange pays the latency and its own padding). When none does, a fragment's
exchange outlasts the steps between two sends whatever P, and the plan names the least
sync_every that fragments=1 would hide it behind. It assumes the exchange runs beside the
compute without slowing it (a GPU's communication has its own engine; gloo's threads on a CPU
share its cores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..engine.diloco import fragment_of
from ..engine.diloco_wire import quantized_bytes
from .comm import wire_bytes
from .sizes import format_seconds

__all__ = ["StreamingPlan", "plan_streaming"]

WIRE = torch.int4  # what the plan sends the pseudo-gradient in (error feedback on: the default)


@dataclass
class StreamingPlan:
    sync_every: int
    fragments: int | None      # None: no setting hides the exchange (see needs_sync_every)
    delay: int | None
    comm_dtype: str
    fragment_bytes: int        # one rank's payload of the largest fragment (of the whole model
    exchange_s: float          # when none hides it), and its all-gather over the link
    compute_s: float
    needs_sync_every: int | None  # when none: the least sync_every that fragments=1 hides

    def line(self) -> str:
        H, P, D = self.sync_every, self.fragments, self.delay
        if P is None:
            steps = max(1, math.ceil(self.exchange_s / self.compute_s))
            return (f"with streaming DiLoCo sync_every={H}, {self.comm_dtype}: no setting hides "
                    f"the exchange: for every fragments dividing {H}, one fragment's takes "
                    f"longer than sync_every / fragments steps of compute (the whole model's: "
                    f"{self.fragment_bytes / 1e6:.3g} MB from each rank, "
                    f"{format_seconds(self.exchange_s)}, {steps} steps of "
                    f"{format_seconds(self.compute_s)}); raise --sync-every to "
                    f"{self.needs_sync_every} or more")
        step_word = "step" if D == 1 else "steps"
        return (f"with streaming DiLoCo sync_every={H}, fragments={P}, delay={D}, "
                f"{self.comm_dtype}: {self.fragment_bytes / 1e6:.3g} MB from each rank per "
                f"fragment every {H // P} steps, {format_seconds(self.exchange_s)} per exchange "
                f"behind {D} {step_word} of compute; px.DiLoCo(sync_every={H}, fragments={P}, "
                f'delay={D}, comm_dtype="{self.comm_dtype}")')


def plan_streaming(sizes: list[int] | None, trainable: int, world: int,
                   link_bytes_per_s: float, latency_s: float, compute_s: float,
                   sync_every: int, scale_bytes: int) -> StreamingPlan:
    """The setting of [Note: planning streaming DiLoCo]. `sizes`: the trainable parameters'
    elements in the model's order (None: a bare count of `trainable`); `scale_bytes`: the
    masters' element size (the pseudo-gradient's dtype, which its scales travel in)."""

    def exchange(parts: int) -> tuple[int, float]:
        if sizes is None:
            largest = [[-(-trainable // parts)]]
        else:
            largest = [[sizes[i] for i in f] for f in fragment_of(sizes, parts)]
        payload = max(quantized_bytes(f, WIRE, scale_bytes) for f in largest)
        hops = world - 1
        return payload, wire_bytes("all_gather", world * payload, world) / link_bytes_per_s \
            + hops * latency_s

    def delay(t: float) -> int:
        return max(1, math.ceil(t / compute_s)) if compute_s > 0 else 1

    most = sync_every if sizes is None else min(sync_every, len(sizes))
    hidden = []
    for parts in (p for p in range(1, most + 1) if sync_every % p == 0):
        payload, t = exchange(parts)
        if delay(t) < sync_every // parts:
            hidden.append((delay(t), parts, payload, t))
    name = "int4"
    if hidden:
        d, parts, payload, t = min(hidden, key=lambda h: h[:2])
        return StreamingPlan(sync_every, parts, d, name, payload, t, compute_s, None)
    payload, t = exchange(1)
    return StreamingPlan(sync_every, None, None, name, payload, t, compute_s, delay(t) + 1)
