"""Offload in the plan: what `offload="optimizer"` and `offload="params"` put in host memory,
what stays on the device, and what they add to a step.

[Note: offload in the plan]
offload="optimizer" (ZeRO-Offload: Ren et al. 2021, arXiv:2101.06840): the master weights and
the optimizer state a rank holds, sharded as its strategy shards them, live in pinned host
memory and the optimizer steps there; the device keeps the compute-dtype parameters (sharded
under zero3) and the gradients. Each step a rank copies its reduced gradients down (the shard
it steps: g x Psi_t / N) and the updated compute-dtype parameters of that shard up (w x Psi_t /
N). Planned for zero1, zero2 and zero3, the stages DeepSpeed offloads the optimizer of.
offload="params" (zero3 only) also keeps zero3's parameter shards, frozen ones included, in
host memory between uses: the device holds only the units being gathered, every gather first
copies the rank's shard up (w x Psi / N per gather, forward and backward, in every micro-step)
and the updated shard stays on the host.

Host memory per rank: the masters (4 bytes per element, or the parameters' own size where they
are their own masters) and the optimizer state of the shard it steps; the fp32 gradients of the
run of units being stepped (the step's working memory moves from the device to the host, and
the fused CPU kernel makes no temporaries of its own) and the compute-dtype gradients of two
units in flight; under offload="params" the parameter shard. Per node: that times the GPUs per
node. It is pinned (page-locked, so copies run at the link's rate) and so must fit in physical
memory: checked against `host_memory` with the device's headroom.

Time, a model, to be checked against the engine's offload on a GPU: the host step streams each
element's master and optimizer state through host memory (read and written), reads its gradient
and writes the fp32 gradient and, under mixed precision, the compute-dtype copy; the ranks of a
node share the host's memory bandwidth (`host_memory_bw`, default 51.2 GB/s: two channels of
DDR4-3200, 2 x 3200 MT/s x 8 bytes, a desktop's; a server's has 4 to 12 channels). Copies
cross each GPU's host link, both directions at once (PCIe is full duplex). The engine steps
each unit as its gradient arrives, so the copies down, the host step and the copies up form a
pipeline beside the last micro-step's backward: the slowest of the three is hidden behind the
backward up to its length, and one unit's share of all three (the last unit's) is exposed.
Under offload="params" a gather's upload is time on the host link in its phase (forward or
backward), overlapped with compute as the gathers are.
"""

from __future__ import annotations

from dataclasses import dataclass

from .memory import ModelStates, step_working_bytes

__all__ = ["OFFLOADS", "offloaded_strategies", "HostSide", "host_side", "device_states",
           "offload_seconds", "DEFAULT_HOST_MEMORY_BW"]

OFFLOADS = ("optimizer", "params")
DEFAULT_HOST_MEMORY_BW = 51.2  # GB/s: dual-channel DDR4-3200


def offloaded_strategies(offload: str | None, strategy: str) -> tuple[str, ...] | None:
    """The strategies planned with `offload` (None: no offload, every strategy), given the
    `strategy` asked for ("all" or one); ValueError for a combination not planned."""
    if offload is None:
        return None
    able = ("zero1", "zero2", "zero3") if offload == "optimizer" else ("zero3",)
    if strategy not in ("all",) + able:
        raise ValueError(f"offload={offload!r} is planned for {', '.join(able)}: "
                         + ("ddp steps the whole optimizer on every rank, so its state is not "
                            "sharded to offload" if offload == "optimizer" else
                            "only zero3 keeps parameter shards between uses")
                         + f" (strategy {strategy!r})")
    return able


@dataclass(frozen=True)
class HostSide:
    """What offload puts in host memory and moves over the host link, per rank."""

    bytes_per_rank: int       # pinned host memory
    down_bytes: int           # gradients copied to the host, per optimizer step
    up_bytes: int             # updated parameters copied to the device, per optimizer step
    gather_up_bytes: dict     # offload="params": shard uploads per micro-step, by phase
    step_traffic_bytes: int   # host memory the host step reads and writes, per rank


def device_states(states: ModelStates, offload: str | None) -> ModelStates:
    """The model states left on the device: no optimizer state under offload, and no
    parameters between uses under offload="params"."""
    if offload is None:
        return states
    return ModelStates(0 if offload == "params" else states.params, states.grads, 0)


def host_side(offload: str, prec, optimizer: str, stepped: list[int], state_elements: int,
              param_shard: int, gathered: dict, run_bytes: int) -> HostSide:
    """`stepped`: the elements of each unit's shard this rank steps; `state_elements`: its
    optimizer-state elements; `param_shard`: the elements of its zero3 parameter shard (all
    parameters); `gathered`: elements gathered per micro-step by phase (forward, backward)."""
    own = sum(stepped)
    master = prec.master_bytes or prec.weight_bytes
    working = step_working_bytes(optimizer, prec, stepped, foreach=False, fused=True,
                                 run_bytes=run_bytes)
    in_flight = 2 * prec.grad_bytes * max(stepped, default=0)
    held = master * own + prec.state_bytes * state_elements + working + in_flight
    params = offload == "params"
    if params:
        held += prec.weight_bytes * param_shard
    converted = (4 + 4 + prec.weight_bytes) if prec.mixed else 0  # fp32 gradient, new copy
    traffic = 2 * (master * own + prec.state_bytes * state_elements) \
        + (prec.grad_bytes + converted) * own
    return HostSide(
        bytes_per_rank=held, down_bytes=prec.grad_bytes * own,
        up_bytes=0 if params else prec.weight_bytes * own,
        gather_up_bytes={phase: prec.weight_bytes * n for phase, n in gathered.items()}
        if params else {}, step_traffic_bytes=traffic)


@dataclass(frozen=True)
class OffloadTime:
    transfer_bytes: float   # over the host link per optimizer step, both directions
    transfer_s: float       # the link's busy time, the busier direction
    host_step_s: float
    exposed_s: float        # added to the overlapped step
    serial_s: float         # added to the step without overlap


def offload_seconds(host: HostSide, gpus_per_node: int, host_link_gbps: float,
                    host_memory_gbps: float, compute_s: float, grad_accum: int,
                    checkpointing: bool, units: int) -> OffloadTime:
    """The pipeline of copies down, host step and copies up beside the last micro-step's
    backward (see [Note: offload in the plan]); the gathers' uploads are timed by comm.py."""
    link = host_link_gbps * 1e9
    down = host.down_bytes / link
    up = host.up_bytes / link
    step = gpus_per_node * host.step_traffic_bytes / (host_memory_gbps * 1e9)
    micro = compute_s / grad_accum
    backward = micro * (0.75 if checkpointing else 2 / 3)
    stages = (down, step, up)
    exposed = max(0.0, max(stages) - backward) + sum(stages) / max(units, 1)
    gathers = grad_accum * sum(host.gather_up_bytes.values())
    return OffloadTime(transfer_bytes=host.down_bytes + host.up_bytes + gathers,
                       transfer_s=max(down, up) + gathers / link, host_step_s=step,
                       exposed_s=exposed, serial_s=sum(stages))
