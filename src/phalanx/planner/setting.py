"""px.plan's options, checked once: four frozen groups, each with its own checks, and the setting
they resolve to together.

    Hardware(gpus=8, nodes=2, gpu="h100", link="1Gbit", ...)    the devices and their links
    Workload(batch=4, seq=4096, optimizer="adamw", ...)         what a step computes, what learns
    Training(strategy="zero3", precision="bf16", ...)           px.prepare's options (or a Spec's)
    Report(headroom=0.1, units="GiB")                           how the plan is judged and written

`px.plan`'s keywords are sugar that builds them (`groups`): each keyword is the field of one group
that has its name, a group given whole takes the keywords over its fields, and a keyword that no
group has is a TypeError naming it, as a function's signature would make it. A group's fields are
what was given, checked and in one spelling; what they resolve to (bytes, GB/s, a precision's
meaning, zero3's `Gathering`) sits beside them, made again whenever the group is
(`dataclasses.replace` included). What needs more than one group is `check_setting`'s: the peak
compute (the GPU at the precision's compute dtype), the shard groups (engine/hybrid.py's rules,
the ones px.prepare applies) and each strategy as its residency row (engine/policy.py), with
offload's places where px.prepare's table of combinations (model/spec.py's COMBINATIONS) lets
the two go together. Every bad value raises ValueError with one line naming it; the command line
turns that into its one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from ..engine.offload import OFFLOADS
from ..engine.policy import POLICIES, SHARD, ShardPolicy, placed
from ..model.precision import COMM_DTYPES
from ..model.spec import COMBINATIONS, Gathering, Offload, Spec, first_refusal, gathering_of
from ..spec.precisions import PrecisionSpec, precision_spec
from ..spec.strategies import STRATEGIES, STRATEGY_ALIASES, strategy_name
from .finetune import check_base_dtype, check_finetune
from .hardware import LINKS, GpuSpec, gpu_spec
from .hybrid import plan_shard_size
from .link import link_latency, parse_link
from .memory import OPTIMIZERS
from .offload import DEFAULT_HOST_MEMORY_BW
from .sizes import parse_bandwidth, parse_bytes

__all__ = ["Hardware", "Workload", "Training", "Report", "Setting", "groups", "check_setting"]

_set = object.__setattr__  # a frozen group's checks put its fields in one spelling, once


def _resolved():
    """A field a group derives from what was given: not an argument, not compared."""
    return field(init=False, repr=False, compare=False)


def _choice(value, choices, what):
    key = str(value).strip().lower()
    if key not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return key


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Hardware:
    """The devices and the links between them. `gpus` is per node, the data-parallel world
    gpus x nodes; sizes and bandwidths as px.plan takes them ("80GB", 25 or "nvlink4" GB/s,
    "1Gbit+20ms"), None for the GPU preset's own."""

    gpus: int = 8
    nodes: int = 1
    gpu: str = "h100"                 # a preset (hardware.py): compute, memory and links
    gpu_memory: object = None         # per device
    peak_tflops: float | None = None  # dense; None: the preset's at the precision's dtype
    mfu: float = 0.4                  # the fraction of the peak reached
    intra_node_bw: object = None
    inter_node_bw: object = "ib-400g"
    link: object = None               # between nodes (+ latency), for the link report
    backend: str = "nccl"             # or "gloo": its primitives and its speed
    host_memory: object = None        # per node, checked against offload's pinned memory
    host_link: object = None          # each GPU's link to host memory
    host_memory_bw: object = None     # GB/s per node (default DEFAULT_HOST_MEMORY_BW)
    preset: GpuSpec = _resolved()
    memory: int = _resolved()             # bytes per device
    intra: float = _resolved()            # GB/s
    inter: float = _resolved()            # GB/s
    link_bps: float | None = _resolved()  # bytes per second
    link_latency_s: float = _resolved()   # what follows a + in link ("100Mbit+20ms")
    host_bytes: int | None = _resolved()  # per node
    host_gbps: float = _resolved()        # per GPU
    host_memory_gbps: float = _resolved()  # per node

    def __post_init__(self):
        _positive_int(self.gpus, "gpus")
        _positive_int(self.nodes, "nodes")
        _set(self, "backend", _choice(self.backend, ("nccl", "gloo"), "backend"))
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu!r}")
        preset = gpu_spec(self.gpu)
        link_bps = parse_link(self.link) if self.link is not None else None
        resolved = dict(
            preset=preset,
            memory=parse_bytes(self.gpu_memory, "GPU memory") if self.gpu_memory is not None
            else preset.memory_bytes,
            intra=parse_bandwidth(self.intra_node_bw if self.intra_node_bw is not None
                                  else preset.link, LINKS, "intra-node bandwidth"),
            link_bps=link_bps)
        if link_bps is not None and self.nodes == 1:
            raise ValueError("link is the bandwidth between nodes, and one node has none to "
                             "cross: give the number of nodes (--nodes 2 or more)")
        resolved.update(
            inter=link_bps / 1e9 if link_bps is not None else
            parse_bandwidth(self.inter_node_bw, LINKS, "inter-node bandwidth"),
            link_latency_s=link_latency(self.link) if self.link is not None else 0.0,
            host_bytes=parse_bytes(self.host_memory, "host memory")
            if self.host_memory is not None else None,
            host_gbps=parse_bandwidth(self.host_link if self.host_link is not None
                                      else preset.host_link, LINKS, "host link bandwidth"),
            host_memory_gbps=parse_bandwidth(self.host_memory_bw if self.host_memory_bw
                                             is not None else DEFAULT_HOST_MEMORY_BW, {},
                                             "host memory bandwidth"))
        for name, value in resolved.items():
            _set(self, name, value)

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def peak_given(self) -> bool:
        return self.peak_tflops is not None

    @property
    def bandwidth(self) -> float:
        """GB/s of a ring through every GPU: across nodes, the slower of the two links."""
        return self.intra if self.nodes == 1 else min(self.intra, self.inter)

    def peak(self, precision: PrecisionSpec) -> float:
        """TFLOP/s dense: as given, or the preset's in the precision's compute dtype."""
        if self.peak_tflops is not None:
            return float(self.peak_tflops)
        return self.preset.peak_tflops(precision)


@dataclass(frozen=True)
class Workload:
    """What one step computes and what learns: the micro-batch per device and its sequence
    length (None: 2048, or a config's learned positions if fewer), the micro-steps per
    optimizer step, activation checkpointing, the attention kernel and the optimizer; with a
    factory, its input's per-sample shape and dtype ("3x224x224", "seq"); fine-tuning, LoRA
    adapters of `lora_rank` beside the `lora_targets` projections, or a `trainable` fraction
    (finetune.py), and the frozen base's storage: `base_dtype="nf4"` (QLoRA: its nn.Linear
    weights 4-bit; None: the compute dtype); `sliced_loss`: the loss is
    px.linear_cross_entropy's, a slice of the vocabulary at a time (from a config)."""

    batch: int = 1
    seq: int | None = None
    grad_accum: int = 1
    activation_checkpointing: bool = False
    attention: str = "eager"
    optimizer: str = "adamw"
    input_shape: object = None
    input_dtype: str = "float32"
    lora_rank: int | None = None
    lora_targets: object = None
    trainable: float | None = None
    base_dtype: str | None = None
    sliced_loss: bool = False
    targets: tuple = _resolved()  # LoRA's projections, the default filled in

    def __post_init__(self):
        _positive_int(self.batch, "batch")
        _positive_int(self.grad_accum, "grad_accum")
        if self.seq is not None:
            _positive_int(self.seq, "seq")
        _set(self, "optimizer", _choice(self.optimizer, OPTIMIZERS, "optimizer"))
        _set(self, "attention", _choice(self.attention, ("eager", "flash"), "attention"))
        _set(self, "activation_checkpointing", bool(self.activation_checkpointing))
        _set(self, "sliced_loss", bool(self.sliced_loss))
        _, targets, trainable = check_finetune(self.lora_rank, self.lora_targets,
                                               self.trainable)
        _set(self, "trainable", trainable)
        _set(self, "targets", targets)
        _set(self, "base_dtype", check_base_dtype(self.base_dtype))


@dataclass(frozen=True)
class Training:
    """px.prepare's options as the plan takes them: the strategy ("all": each, and the pick;
    "fsdp" is zero3), the precision (a name of spec/precisions.py, or its PrecisionSpec), the
    cap of a unit, the gradients' dtype on the wire, zero3's gathering, the shard groups (K
    ranks, or "node": the GPUs of one), offload and the step in backward (each unit stepped as
    soon as its gradient is reduced); and the link report's what-ifs, PowerSGD's rank and
    DiLoCo's sync_every. `Training.of(spec)`: a px.prepare Spec's."""

    strategy: str = "all"
    precision: object = "bf16"
    bucket_mb: float = 25.0
    comm_dtype: object = None
    prefetch: int | None = 1
    max_gathered_mb: float | None = None
    reshard_after_forward: bool = True
    shard_size: object = None
    offload: str | None = None
    step_in_backward: bool = False
    powersgd_rank: int = 4
    sync_every: int = 50
    comm: torch.dtype | None = _resolved()  # comm_dtype's meaning (None: the gradients' own)
    gathering: Gathering = _resolved()      # zero3's, as px.prepare checks them

    def __post_init__(self):
        if not isinstance(self.precision, PrecisionSpec):
            _set(self, "precision", precision_spec(self.precision, planner=True))
        key = _choice(self.strategy, STRATEGIES + tuple(STRATEGY_ALIASES) + ("all",), "strategy")
        _set(self, "strategy", key if key == "all" else strategy_name(key))
        if self.offload is not None:
            _set(self, "offload", _choice(self.offload, OFFLOADS, "offload"))
        if self.comm_dtype != "none" and self.comm_dtype not in COMM_DTYPES:
            raise ValueError(f"unknown comm_dtype {self.comm_dtype!r}: choose bf16, fp16 or none")
        _set(self, "comm", None if self.comm_dtype == "none" else COMM_DTYPES[self.comm_dtype])
        if not isinstance(self.step_in_backward, bool):
            raise ValueError(f"step_in_backward={self.step_in_backward!r}: True (each unit "
                             "stepped as soon as its gradient is reduced) or False")
        _set(self, "gathering", gathering_of(self.prefetch, self.max_gathered_mb,
                                           self.reshard_after_forward))

    @property
    def comm_bytes(self) -> int | None:
        """Bytes of a gradient element on the wire (None: the compute dtype's)."""
        return None if self.comm is None else self.comm.itemsize

    @classmethod
    def of(cls, spec: Spec) -> Training:
        """The options of px.prepare's `spec` (model/spec.py): its strategy with its
        precision, unit cap, comm_dtype, gathering, shard groups, offload and step in backward.
        A plan is a strategy's memory and step: a spec with a feature beside it is refused, by
        name."""
        for feature, what in ((spec.staleness, "staleness=1"),
                              (spec.compression, "compression=PowerSGD(...)"),
                              (spec.diloco, "strategy=DiLoCo(...)")):
            if feature is not None:
                raise ValueError(f"px.plan(spec=...): the spec has {what}, which the plan does "
                                 "not model (its memory and step are the strategy's alone); "
                                 "plan the spec without it, and give link= for what PowerSGD "
                                 "and DiLoCo would send over the link between nodes")
        gathering = spec.gathering or Gathering()
        return cls(strategy=spec.strategy, precision=spec.precision, bucket_mb=spec.bucket_mb,
                   comm_dtype=spec.comm_dtype, prefetch=gathering.prefetch,
                   max_gathered_mb=gathering.max_gathered_mb,
                   reshard_after_forward=gathering.reshard_after_forward,
                   shard_size=spec.shard_size,
                   offload=None if spec.offload is None else spec.offload.what,
                   step_in_backward=bool(getattr(spec, "step_in_backward", False)))


@dataclass(frozen=True)
class Report:
    """How the plan is judged and written: the share of device (and host) memory kept free
    when recommending, and the unit of the memory figures ("GB": 1e9 bytes, "GiB": 2^30)."""

    headroom: float = 0.1
    units: str = "GB"

    def __post_init__(self):
        _set(self, "units", {"gb": "GB", "gib": "GiB"}[_choice(self.units, ("gb", "gib"),
                                                                "units")])
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom!r}")


_SPEC_HAS_BASE_DTYPE = "base_dtype" in {f.name for f in fields(Spec)}  # px.prepare's QLoRA

_GROUPS = {"hardware": Hardware, "workload": Workload, "training": Training, "report": Report}
_FIELDS = {f.name: group for group, cls in _GROUPS.items() for f in fields(cls) if f.init}


def groups(keywords: dict, where: str = "plan", **given) -> tuple[Hardware, Workload, Training,
                                                                   Report]:
    """The four groups a plan is made of: each the one `given` (hardware=, workload=,
    training= or px.prepare's spec=) or its defaults, with `keywords` (px.plan's) over its
    fields; TypeError for a keyword that no group has, as `where`'s signature would raise."""
    for name in keywords:
        if name not in _FIELDS:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
    spec = given.pop("spec", None)
    if spec is not None:
        if given.get("training") is not None:
            raise TypeError(f"{where}() takes training= or spec= (px.prepare's), not both")
        given["training"] = Training.of(spec)
        base_dtype = getattr(spec, "base_dtype", None)  # px.prepare's QLoRA base: Workload's
        if base_dtype is not None and "base_dtype" not in keywords:
            keywords = {**keywords, "base_dtype": base_dtype}
    out = []
    for group, cls in _GROUPS.items():
        base = given.get(group)
        mine = {k: v for k, v in keywords.items() if _FIELDS[k] == group}
        if base is None:
            out.append(cls(**mine))
        elif not isinstance(base, cls):
            raise TypeError(f"{where}() takes {group}= as a {cls.__name__}, not {base!r}")
        else:
            out.append(replace(base, **mine) if mine else base)
    return tuple(out)


@dataclass(frozen=True)
class Setting:
    """The groups, and what they resolve to together (see the module docstring). `rows`:
    every strategy's residency row, in STRATEGIES' order, with offload's places where the two
    go together (a row they do not, ddp's, is planned bare, for the link report); `candidates`:
    the rows planned with the options given, which the pick is made from; `shown`: the rows the
    plan shows (the one asked for, or the candidates)."""

    hardware: Hardware
    workload: Workload
    training: Training
    report: Report
    peak: float                  # TFLOP/s at the precision's compute dtype
    shard_size: int | None       # K, None: the flat layout
    rows: tuple[ShardPolicy, ...]
    candidates: tuple[ShardPolicy, ...]
    shown: tuple[ShardPolicy, ...]

    @property
    def world(self) -> int:
        return self.hardware.world

    @property
    def precision(self) -> PrecisionSpec:
        return self.training.precision

    def changed(self, **changes) -> Setting:
        """The same setting with other options (Workload's or Training's: fine-tuning, the
        optimizer, the precision, offload, the step in backward), every strategy they go with
        planned (alternatives.py). Offload goes without the step in backward (px.prepare
        refuses the two together)."""
        training = {k: changes.pop(k) for k in list(changes) if _FIELDS[k] == "training"}
        if training.get("offload") is not None:
            training.setdefault("step_in_backward", False)
        return check_setting(self.hardware, replace(self.workload, **changes),
                             replace(self.training, strategy="all", **training), self.report)


def _planned(policy: ShardPolicy, t: Training,
             base_dtype: str | None = None) -> tuple[Spec, str | None]:
    """`policy` under `t` (and a 4-bit base: `base_dtype`, Workload's) as the Spec px.prepare
    resolves (its row with offload's places), and the message of the first combination of its
    table that refuses it (None: none does)."""
    # zero3's gathering options are given to zero3 alone (the other rows ask for none)
    gathering = t.gathering if policy.params is SHARD else Gathering(prefetch=None)
    spec = Spec(policy=policy, precision=t.precision, comm_dtype=t.comm, output_dtype=None,
                bucket_mb=t.bucket_mb, gathering=gathering, shard_size=t.shard_size,
                staleness=None, compression=None,
                offload=None if t.offload is None else Offload(t.offload), diloco=None,
                step_in_backward=t.step_in_backward)
    if base_dtype is not None and _SPEC_HAS_BASE_DTYPE:
        spec = replace(spec, base_dtype=base_dtype)
    refusal = first_refusal(spec, COMBINATIONS)
    return replace(spec, policy=placed(policy, t.offload)), refusal


def check_setting(hardware: Hardware, workload: Workload, training: Training,
                  report: Report) -> Setting:
    """The setting of checked groups: each strategy's row, those planned and shown, the shard
    groups and the peak; ValueError with one line for options that do not go together."""
    planned = [_planned(POLICIES[name], training, workload.base_dtype) for name in STRATEGIES]
    rows = tuple(spec.policy if refusal is None else POLICIES[name]
                 for name, (spec, refusal) in zip(STRATEGIES, planned))
    candidates = tuple(spec.policy for spec, refusal in planned if refusal is None)
    if not candidates:  # options that no strategy takes together (zero3's refusal: the least)
        raise ValueError(planned[-1][1])
    if training.strategy == "all":
        shown = candidates
    else:
        spec, refusal = planned[STRATEGIES.index(training.strategy)]
        alone = _planned(POLICIES[training.strategy], replace(training, offload=None),
                         workload.base_dtype)[1] if refusal is not None else None
        if refusal is not None and training.offload is not None and alone is None:
            why = ("only zero3 keeps parameter shards between uses"
                   if Offload(training.offload).params else "ddp steps the whole optimizer on "
                   "every rank, so its state is not sharded to offload")
            raise ValueError(f"offload={training.offload!r} is planned for "
                             f"{', '.join(row.name for row in candidates)}: {why} "
                             f"(strategy {training.strategy!r})")
        if refusal is not None:
            raise ValueError(alone or refusal)
        shown = (spec.policy,)
    # the rows planned in shard groups: the one asked for, or each of those that shard (ddp's
    # figures beside them are the flat layout's)
    grouped = shown if training.strategy != "all" else [r for r in shown
                                                        if r.optimizer is SHARD]
    return Setting(hardware=hardware, workload=workload, training=training, report=report,
                   peak=hardware.peak(training.precision),
                   shard_size=plan_shard_size(training.shard_size, hardware.world,
                                              hardware.gpus, grouped),
                   rows=rows, candidates=candidates, shown=shown)
