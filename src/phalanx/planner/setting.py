"""px.plan's options, checked once: the devices, the training setting and the fine-tuning
options, resolved to numbers (bytes, GB/s, a precision's meaning). Every bad value raises
ValueError with one line naming it; the command line turns that into its one-line error."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..engine.units import check_gather_options
from ..spec.precisions import PrecisionSpec, precision_spec
from .finetune import check_finetune
from .hardware import LINKS, GpuSpec, gpu_spec
from .hybrid import check_plan_shard_size
from .link import link_latency, parse_link
from .memory import OPTIMIZERS, STRATEGIES
from .offload import DEFAULT_HOST_MEMORY_BW, OFFLOADS, offloaded_strategies
from .sizes import parse_bandwidth, parse_bytes

__all__ = ["Setting", "check_setting"]

_COMM_DTYPES = {None: None, "none": None, "bf16": 2, "fp16": 2, "fp32": 4,
                torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


@dataclass(frozen=True)
class Setting:
    gpus: int                    # per node
    nodes: int
    shard_size: int | None
    spec: GpuSpec
    memory: int                  # bytes per device
    peak: float                  # TFLOP/s
    peak_given: bool
    mfu: float
    intra: float                 # GB/s
    inter: float
    link_bps: float | None
    precision: PrecisionSpec
    optimizer: str
    strategy: str                # "all" or one of STRATEGIES
    candidates: tuple            # the strategies planned
    batch: int
    seq: int | None
    grad_accum: int
    checkpointing: bool
    attention: str
    backend: str
    units: str
    comm_dtype: object
    comm_bytes: int | None
    bucket_mb: float
    gather: dict                 # zero3's gathering options, as engine/units.py checks them
    headroom: float
    powersgd_rank: int
    sync_every: int
    lora_rank: int | None
    lora_targets: tuple
    trainable: float | None
    offload: str | None
    host_memory: int | None      # bytes per node (checked under offload, and its alternatives)
    host_link: float             # GB/s per GPU
    host_memory_bw: float        # GB/s per node
    link_latency_s: float = 0.0  # what follows a + in link ("100Mbit+20ms")

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def bandwidth(self) -> float:
        return self.intra if self.nodes == 1 else min(self.intra, self.inter)

    @property
    def shown(self) -> tuple:
        if self.strategy == "all":
            return self.candidates
        return (self.strategy,)

    def changed(self, **changes) -> Setting:
        """The same setting with other fine-tuning or offload options (alternatives.py)."""
        out = replace(self, **changes)
        candidates = offloaded_strategies(out.offload, "all") or STRATEGIES
        return replace(out, candidates=candidates, strategy="all")


def _choice(value, choices, what):
    key = str(value).strip().lower()
    if key not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return key


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def check_setting(*, gpus, nodes, gpu, gpu_memory, peak_tflops, mfu, strategy, precision,  # noqa: PLR0913
                  optimizer, batch, seq, grad_accum, activation_checkpointing, intra_node_bw,
                  inter_node_bw, bucket_mb, comm_dtype, attention, backend, headroom, units,
                  prefetch, max_gathered_mb, reshard_after_forward, link, powersgd_rank,
                  sync_every, shard_size, lora_rank, lora_targets, trainable, offload,
                  host_memory, host_link, host_memory_bw) -> Setting:
    gpus, nodes = _positive_int(gpus, "gpus"), _positive_int(nodes, "nodes")
    batch, grad_accum = _positive_int(batch, "batch"), _positive_int(grad_accum, "grad_accum")
    if seq is not None:
        seq = _positive_int(seq, "seq")
    shard_size = check_plan_shard_size(shard_size, gpus * nodes, gpus)
    prec = precision_spec(precision, planner=True)
    optimizer = _choice(optimizer, OPTIMIZERS, "optimizer")
    strategy = _choice(strategy, STRATEGIES + ("fsdp", "all"), "strategy")
    strategy = "zero3" if strategy == "fsdp" else strategy
    if offload is not None:
        offload = _choice(offload, OFFLOADS, "offload")
    candidates = offloaded_strategies(offload, strategy) or STRATEGIES
    attention = _choice(attention, ("eager", "flash"), "attention")
    backend = _choice(backend, ("nccl", "gloo"), "backend")
    units = {"gb": "GB", "gib": "GiB"}[_choice(units, ("gb", "gib"), "units")]
    if comm_dtype not in _COMM_DTYPES:
        raise ValueError(f"unknown comm_dtype {comm_dtype!r}: choose bf16, fp16 or none")
    comm_bytes = _COMM_DTYPES[comm_dtype.lower() if isinstance(comm_dtype, str) else comm_dtype]
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    lora_rank, lora_targets, trainable = check_finetune(lora_rank, lora_targets, trainable)

    spec = gpu_spec(gpu)
    memory = parse_bytes(gpu_memory, "GPU memory") if gpu_memory is not None else spec.memory_bytes
    peak = float(peak_tflops) if peak_tflops is not None else spec.peak_tflops(prec.name)
    intra = parse_bandwidth(intra_node_bw if intra_node_bw is not None else spec.link, LINKS,
                            "intra-node bandwidth")
    link_bps = parse_link(link) if link is not None else None
    if link_bps is not None and nodes == 1:
        raise ValueError("link is the bandwidth between nodes, and one node has none to cross: "
                         "give the number of nodes (--nodes 2 or more)")
    inter = link_bps / 1e9 if link_bps is not None else \
        parse_bandwidth(inter_node_bw, LINKS, "inter-node bandwidth")
    host_bytes = parse_bytes(host_memory, "host memory") if host_memory is not None else None
    host_gbps = parse_bandwidth(host_link if host_link is not None else spec.host_link, LINKS,
                                "host link bandwidth")
    host_mem_gbps = parse_bandwidth(host_memory_bw if host_memory_bw is not None
                                    else DEFAULT_HOST_MEMORY_BW, {}, "host memory bandwidth")
    return Setting(
        gpus=gpus, nodes=nodes, shard_size=shard_size, spec=spec, memory=memory, peak=peak,
        peak_given=peak_tflops is not None, mfu=mfu, intra=intra, inter=inter,
        link_bps=link_bps, precision=prec, optimizer=optimizer, strategy=strategy,
        candidates=candidates, batch=batch, seq=seq, grad_accum=grad_accum,
        checkpointing=bool(activation_checkpointing), attention=attention, backend=backend,
        units=units, comm_dtype=comm_dtype, comm_bytes=comm_bytes, bucket_mb=bucket_mb,
        gather=check_gather_options("zero3", prefetch, max_gathered_mb, reshard_after_forward),
        headroom=headroom, powersgd_rank=powersgd_rank, sync_every=sync_every,
        lora_rank=lora_rank, lora_targets=lora_targets, trainable=trainable, offload=offload,
        host_memory=host_bytes, host_link=host_gbps, host_memory_bw=host_mem_gbps,
        link_latency_s=link_latency(link) if link is not None else 0.0)
