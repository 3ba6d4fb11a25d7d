"""Offload in the plan: what `offload="optimizer"` and `offload="params"` put in host memory,
what stays on the device, and what they add to a step.

[Note: offload in the plan]
offload="optimizer" (ZeRO-Offload: Ren et al. 2021, arXiv:2101.06840): the master weights and
the optimizer state a rank holds, sharded as its strategy shards them, live in pinned host
memory and the optimizer steps there; the device keeps the compute-dtype parameters (sharded
under zero3) and the gradients (zero1's; under zero2 and zero3 about two units' shards, the rest
copied down as they are made). Each step a rank copies its reduced gradients down (the shard
it steps: g x Psi_t / N) and the updated compute-dtype parameters of that shard up (w x Psi_t /
N). Planned for zero1, zero2 and zero3, the stages DeepSpeed offloads the optimizer of (the rows
px.prepare's table of combinations lets it go with, model/spec.py: planner/setting.py asks it).
offload="params" (zero3 only) also keeps zero3's parameter shards, frozen ones included, in
host memory between uses: the device holds only the units being gathered, every gather first
copies the rank's shard up (w x Psi / N per gather, forward and backward, in every micro-step)
and the updated shard stays on the host.

Host memory per rank, what engine/offload.py holds: the masters (4 bytes per element, or the
parameters' own size where they are their own masters) and the optimizer state of the shard it
steps; the landing buffers of the gradients copied down, two (the run stepping, the next one
landing), each as large as the largest run of units it takes (the runs of units.py's
`step_runs`, alternating), or, where the gradients are sharded (zero2, zero3), the whole
gradient shard: each unit's reduced shard is copied down as it is made (DeepSpeed's layout),
so the device holds about two units' shards (the one copied and the one reduced meanwhile) and
the host all of them; under mixed precision one run's gradients in the master dtype (the
fused CPU kernel makes no temporaries of its own) and two units' staging buffers, where each
stepped master is cast to the compute dtype before it is copied up; under "bf16-true" one run's
weights, gradients and optimizer state upcast to fp32 for its step; under offload="params"
the compute-dtype shard (the master itself in fp32) and the frozen shards. Per node: that
times the GPUs per node. It is pinned (page-locked, so copies run at the link's rate) and so
must fit in physical memory: checked against `host_memory` with the device's headroom.

Time, a model, to be checked against the engine's offload on a GPU: the host step streams each
element's master and optimizer state through host memory (read and written), reads its gradient
and writes the fp32 gradient and, under mixed precision, the compute-dtype copy; the ranks of a
node share the host's memory bandwidth (`host_memory_bw`, default 51.2 GB/s: two channels of
DDR4-3200, 2 x 3200 MT/s x 8 bytes, a desktop's; a server's has 4 to 12 channels). Copies
cross each GPU's host link, both directions at once (PCIe is full duplex). The engine steps at
`optimizer.step()`, after backward (a unit stepped during backward would be stepped before the
clipping, the overflow check and the step vote decide over the whole step), a run of units at a
time: the next run's gradients are copied down while a run steps, and each stepped run's
parameters are copied up while the next steps. So the three stages form a pipeline after the
backward, not beside it: the slowest stage's whole time is exposed, plus one run's share of the
other two (the first run's copy down before the first step, the last run's copy up after the
last). With the host step the slowest, that is the host step + the first copy down + the last
copy up. Under offload="params" a gather's upload is time on the host link in its phase
(forward or backward), overlapped with compute as the gathers are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engine.policy import DEVICE, HOST, ShardPolicy
from ..engine.units import step_runs
from .memory import ModelStates

__all__ = ["HostSide", "host_side", "device_states", "offload_seconds",
           "DEFAULT_HOST_MEMORY_BW"]

DEFAULT_HOST_MEMORY_BW = 51.2  # GB/s: dual-channel DDR4-3200


@dataclass(frozen=True)
class HostSide:
    """What offload puts in host memory and moves over the host link, per rank."""

    bytes_per_rank: int       # pinned host memory
    down_bytes: int           # gradients copied to the host, per optimizer step
    up_bytes: int             # updated parameters copied to the device, per optimizer step
    gather_up_bytes: dict     # offload="params": shard uploads per micro-step, by phase
    step_traffic_bytes: int   # host memory the host step reads and writes, per rank
    runs: int = 1             # runs of units the host step takes, one after the other


def device_states(states: ModelStates, policy: ShardPolicy, world: int,
                  shard_bytes: int) -> ModelStates:
    """The model states the residency row `policy` leaves on the device on `world` ranks: all
    of them with the masters there; else no optimizer state, and of the parameters, where zero3
    shards them, the compute-dtype shards, `shard_bytes` (what the gathers start from, the
    master being on the host), and none between uses with the shards on the host too."""
    if policy.masters is DEVICE:
        return states
    if policy.shards is HOST:
        return ModelStates(0, states.grads, 0)
    return ModelStates(shard_bytes if policy.reshards(world) else states.params, states.grads, 0)


def _alternating(sizes: list[int]) -> int:
    """Two buffers taken in turn by `sizes`: the largest of the even ones plus the largest of
    the odd ones (each buffer grows to the most it held: engine/offload.py's HostLink)."""
    return max(sizes[0::2], default=0) + max(sizes[1::2], default=0)


def host_side(policy: ShardPolicy, prec, stepped: list[int], state_elements: int,
              frozen_shard: int, gathered: dict, run_bytes: int,
              state_bytes: float | None = None, frozen_bytes: float | None = None,
              grads_on_host: bool = False) -> HostSide:
    """What the residency row `policy`, its masters on the host, puts there and moves to and
    fro. `stepped`: the elements of each unit's shard this rank steps, in the engine's order;
    `state_elements`: its optimizer-state elements; `frozen_shard`: the elements of its zero3
    frozen shards; `gathered`: elements gathered per micro-step by phase (forward,
    backward); `state_bytes`, `frozen_bytes`: per optimizer-state and frozen element (None:
    the precision's, the compute dtype's); `grads_on_host`: each reduced gradient shard is
    copied down as it is made (zero2, zero3), so the host holds the rank's whole gradient shard
    in place of two landing buffers."""
    own = sum(stepped)
    master = prec.master_bytes or prec.weight_bytes
    sb = prec.state_bytes if state_bytes is None else state_bytes
    fb = prec.weight_bytes if frozen_bytes is None else frozen_bytes
    runs = [[stepped[i] for i in run] for run in step_runs([master * u for u in stepped],
                                                            run_bytes)] or [[0]]
    landing = prec.grad_bytes * (own if grads_on_host else
                                 _alternating([sum(run) for run in runs]))
    held = master * own + math.ceil(sb * state_elements) + landing
    params = policy.shards is HOST  # offload="params"
    if prec.mixed:  # the gradients widened to the master dtype, a run at a time
        held += master * max(sum(run) for run in runs)
        if not params:  # each master cast into staging before its copy up
            held += prec.weight_bytes * (max(max(run[0::2], default=0) for run in runs)
                                         + max(max(run[1::2], default=0) for run in runs))
    elif prec.compute_dtype is not None:  # bf16-true: a run's weights, gradients and state
        largest = max(sum(run) for run in runs)  # in fp32 for its step (engine/rounding.py)
        held += math.ceil(4 * largest * (2 + state_elements / max(own, 1)))
    if params:  # the shards between uses: the compute-dtype shard apart from a mixed master
        held += prec.weight_bytes * (own if prec.mixed else 0) + math.ceil(fb * frozen_shard)
    converted = (4 + 4 + prec.weight_bytes) if prec.mixed else 0  # fp32 gradient, new copy
    traffic = 2 * (master * own + math.ceil(sb * state_elements)) \
        + (prec.grad_bytes + converted) * own
    return HostSide(
        bytes_per_rank=held, down_bytes=prec.grad_bytes * own,
        up_bytes=0 if params else prec.weight_bytes * own,
        gather_up_bytes={phase: math.ceil(prec.weight_bytes * n)
                         for phase, n in gathered.items()}
        if params else {}, step_traffic_bytes=traffic, runs=len(runs))


@dataclass(frozen=True)
class OffloadTime:
    transfer_bytes: float   # over the host link per optimizer step, both directions
    transfer_s: float       # the link's busy time, the busier direction
    host_step_s: float
    exposed_s: float        # added to the overlapped step
    serial_s: float         # added to the step without overlap


def offload_seconds(host: HostSide, gpus_per_node: int, host_link_gbps: float,
                    host_memory_gbps: float, grad_accum: int = 1) -> OffloadTime:
    """The pipeline of copies down, host step and copies up after the backward, a run of units
    at a time (see [Note: offload in the plan]); the gathers' uploads are timed by comm.py."""
    link = host_link_gbps * 1e9
    down = host.down_bytes / link
    up = host.up_bytes / link
    step = gpus_per_node * host.step_traffic_bytes / (host_memory_gbps * 1e9)
    stages = (down, step, up)
    exposed = max(stages) + (sum(stages) - max(stages)) / max(host.runs, 1)
    gathers = grad_accum * sum(host.gather_up_bytes.values())
    return OffloadTime(transfer_bytes=host.down_bytes + host.up_bytes + gathers,
                       transfer_s=max(down, up) + gathers / link, host_step_s=step,
                       exposed_s=exposed, serial_s=sum(stages))
