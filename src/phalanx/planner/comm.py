"""Time per step: communication volume over a ring, compute at a stated utilisation, overlap.

[Note: Communication model]
Per rank and per optimizer step, with G the gradient bytes as communicated and P the parameter
bytes, a ring moves (Patarasuk & Yuan 2009; the NCCL "bus bandwidth" convention):

    all-reduce of B bytes       2 (N-1)/N * B     (reduce-scatter then all-gather)
    reduce-scatter / all-gather   (N-1)/N * B

    ddp    all-reduce G                                  ~ 2x the gradient bytes
    zero1  reduce-scatter G + all-gather P (new weights)  ~ 2x
    zero2  the same as zero1                             ~ 2x
    zero3  all-gather P (forward) + all-gather P (backward), per micro-step, + reduce-scatter G ~ 3x
           (backward does not gather again what stays gathered: the units rooted at the model
           and the root the forward ends with, layout.py's `zero3_gathering`; a bare count
           knows neither, and is planned as if backward gathered every unit again)

On gloo phalanx all-reduces instead of reduce-scattering (faster there, see collectives.py), so
zero1/zero2 move 2G + P. With gradient accumulation (`px.no_sync`) gradients are reduced once
per step, under zero3 too (phalanx's zero3 accumulates full gradients in its buckets under
`no_sync`, as zero2 does, where FSDP reduce-scatters in every micro-step: less communication
for the memory of one unsharded gradient); zero3 gathers parameters in every micro-step. The
time is bytes / bandwidth, where the
bandwidth is the intra-node link on one node and the slower of the two links across nodes (a
ring through every GPU crosses the inter-node links). Latency is left out: it matters only for
small messages, and buckets are megabytes.

[Note: Overlap model]
Training FLOPs are 3x forward (backward ~ 2x forward), 4x with activation checkpointing. The
gradient reduction overlaps the backward of the last micro-step; the all-gather of updated
weights (zero1/zero2) follows the optimizer step and is exposed; zero3's forward gathers overlap
the forward and its backward gathers and reduce-scatter overlap the backward, except the first
unit's gather and the last unit's reduce-scatter (1/units of it). Scaling efficiency
is compute time / overlapped step time: the fraction of linear scaling that is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.policy import SHARD, ShardPolicy

__all__ = ["Collective", "collectives", "wire_bytes", "StepTime", "step_time"]


@dataclass(frozen=True)
class Collective:
    op: str          # "all_reduce", "reduce_scatter" or "all_gather"
    payload: int     # bytes of the tensor handed to the collective (all-gather: its output)
    phase: str       # "backward", "forward" or "after_step": what it can overlap with
    per_micro_step: bool = False


def wire_bytes(op: str, payload: int, world: int) -> float:
    """Bytes a rank sends (and receives) on a ring for one collective."""
    if world <= 1:
        return 0.0
    factor = 2.0 if op == "all_reduce" else 1.0
    return factor * (world - 1) / world * payload


def collectives(policy: ShardPolicy, grad_bytes: int, param_bytes: int, world: int,
                reduce_scatter: bool, kept_bytes: int = 0) -> list[Collective]:
    """The collectives of one optimizer step of the residency row `policy` (see [Note:
    Communication model]). `kept_bytes`: zero3's parameters that stay gathered from forward to
    backward (the units rooted at the model itself and the root the forward ends with,
    engine/zero3.py), which backward does not gather again."""
    if world <= 1:
        return []
    # full gradients are all-reduced (ddp, zero1: engine/policy.py); sharded ones reduced to
    # the owned shard, by a reduce-scatter where the backend has one
    reduce = "reduce_scatter" if reduce_scatter and policy.grads is SHARD else "all_reduce"
    grads = Collective(reduce, grad_bytes, "backward")
    if policy.params is SHARD:  # gathered in every forward, and in backward what was freed
        again = [Collective("all_gather", param_bytes - kept_bytes, "backward",
                            per_micro_step=True)] if param_bytes > kept_bytes else []
        return [Collective("all_gather", param_bytes, "forward", per_micro_step=True),
                *again, grads]
    if policy.optimizer is SHARD:  # each rank's updated shard, gathered after the step
        return [grads, Collective("all_gather", param_bytes, "after_step")]
    return [grads]


@dataclass(frozen=True)
class StepTime:
    comm_bytes: float        # wire bytes per rank per step
    payload_by_op: dict      # op -> payload bytes per step (what phalanx's Comm records count)
    comm_s: float
    compute_s: float
    step_s: float            # with overlap
    step_no_overlap_s: float
    scaling_efficiency: float
    across_payload: int = 0  # shard_size: bytes handed to collectives across groups (hybrid.py)


def step_time(colls: list[Collective], world: int, compute_s: float, grad_accum: int,
              bandwidth_gbps: float, checkpointing: bool, units: int = 1,
              across: list[Collective] = (), replicas: int = 1,
              across_gbps: float | None = None, host_phase_s: dict | None = None) -> StepTime:
    """Combine collectives and compute into a step time (see [Note: Overlap model]). `across`:
    with shard_size, the backward's collectives over the `replicas` groups, at `across_gbps`
    (planner/hybrid.py); `colls` and `world` are then the group's. `host_phase_s`: seconds on
    the host link per micro-step by phase (zero3's shard uploads under offload="params",
    planner/offload.py), a third resource beside compute and the network."""
    host = {"forward": 0.0, "backward": 0.0, **(host_phase_s or {})}
    by_phase = {"forward": 0.0, "backward": 0.0, "after_step": 0.0}
    comm_bytes = 0.0
    payload: dict[str, int] = {}
    for c in colls:
        repeats = grad_accum if c.per_micro_step else 1
        wire = wire_bytes(c.op, c.payload, world) * repeats
        comm_bytes += wire
        payload[c.op] = payload.get(c.op, 0) + c.payload * repeats
        by_phase[c.phase] += wire / repeats  # per micro-step where it repeats
    bw = bandwidth_gbps * 1e9
    t = {k: v / bw for k, v in by_phase.items()}
    comm_s = comm_bytes / bw
    across_wire = sum(wire_bytes(c.op, c.payload, replicas) for c in across)
    if across_wire:
        across_s = across_wire / ((across_gbps or bandwidth_gbps) * 1e9)
        t["backward"] += across_s
        comm_s += across_s
        comm_bytes += across_wire
    micro = compute_s / grad_accum
    fwd = micro * (0.25 if checkpointing else 1 / 3)
    bwd = micro - fwd
    per_micro = any(c.per_micro_step for c in colls)
    if per_micro:  # zero3: every micro-step gathers and reduces
        exposed = (t["forward"] + t["backward"] + host["forward"] + host["backward"]) \
            / max(units, 1)  # first gather, last reduce
        step = grad_accum * (max(fwd, t["forward"], host["forward"])
                             + max(bwd, t["backward"], host["backward"]) + exposed) \
            + t["after_step"]
    else:
        step = (grad_accum - 1) * micro + fwd + max(bwd, t["backward"]) + t["after_step"]
    no_overlap = compute_s + comm_s + grad_accum * (host["forward"] + host["backward"])
    eff = compute_s / step if step > 0 else 1.0
    return StepTime(comm_bytes=comm_bytes, payload_by_op=payload, comm_s=comm_s,
                    compute_s=compute_s, step_s=step, step_no_overlap_s=no_overlap,
                    scaling_efficiency=eff, across_payload=sum(c.payload for c in across))
