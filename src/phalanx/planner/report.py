"""The plan as data (`to_dict`, the JSON of `phalanx plan --json`) and as a table (`str`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .sizes import GB, GiB, format_count, format_seconds

__all__ = ["StrategyPlan", "PlanResult"]


@dataclass
class StrategyPlan:
    """One strategy's memory per device and time per step. Bytes are exact integers."""

    strategy: str
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    buffers_bytes: int
    buffers_detail: dict
    step_working_bytes: int      # optimizer-step transients; never alive with activations
    total_bytes: int             # the peak per device, see [Note: Peak] in memory.py
    peak_at: str                 # "backward start", "end of backward" or "optimizer step"
    fits: bool                   # total <= GPU memory
    fits_with_headroom: bool     # total <= (1 - headroom) x GPU memory
    comm_bytes_per_step: float   # bytes each rank sends per optimizer step, ring algorithms
    comm_payload_bytes: dict     # op -> bytes handed to collectives per step (comm_counter's view)
    comm_time_s: float
    compute_time_s: float
    step_time_s: float           # communication overlapped with compute
    step_time_no_overlap_s: float
    scaling_efficiency: float    # compute time / step time
    tokens_per_s: float | None   # all ranks together
    # shard_size (planner/hybrid.py): payload per step within a shard group and across groups
    intra_group_payload_bytes: int = 0
    inter_group_payload_bytes: int = 0
    # offload (planner/offload.py): pinned host memory, and what the host side adds to a step
    host_bytes: int = 0               # per rank
    host_bytes_per_node: int = 0
    fits_host: bool | None = None     # None: no offload, or host memory not given
    host_transfer_bytes: float = 0    # over the host link per step and rank, both directions
    host_transfer_s: float = 0.0
    host_step_s: float = 0.0          # the optimizer step on the host

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


@dataclass
class PlanResult:
    """What `px.plan(...)` returns. `str(result)` is the table `phalanx plan` prints."""

    model: dict
    setting: dict
    strategies: dict[str, StrategyPlan]
    recommended: str | None
    reason: str
    notes: list[str] = field(default_factory=list)
    units: str = "GB"
    link: object = None  # a LinkReport (link.py) when a link was given
    alternatives: list = field(default_factory=list)  # what fits instead (alternatives.py)

    def __getitem__(self, strategy: str) -> StrategyPlan:
        return self.strategies[strategy]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "setting": self.setting,
            "units": {"bytes": "all *_bytes values are bytes", "GB": GB, "GiB": GiB},
            "strategies": {name: asdict(s) for name, s in self.strategies.items()},
            "recommended": self.recommended,
            "reason": self.reason,
            "notes": list(self.notes),
            "alternatives": [a.to_dict() for a in self.alternatives],
            **({"link": self.link.to_dict()} if self.link is not None else {}),
        }

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return format_table(self)


def _mem(n: float, unit: str) -> str:
    return f"{n / (GB if unit == 'GB' else GiB):.2f}"


def format_table(r: PlanResult) -> str:
    s, m, u = r.setting, r.model, r.units
    offload = s.get("offload")
    names = list(r.strategies)
    scale_name = "1e9" if u == "GB" else "2^30"
    what = (f"{format_count(m['params'])} parameters (a count: no shapes)" if m["source"] == "count"
            else f"{m['name']} ({format_count(m['params'])} parameters, from a {m['source']})")
    tune = m.get("finetune")
    if tune:
        trainable = format_count(m["trainable_params"])
        what += (f"; LoRA rank {tune['lora_rank']} on {', '.join(tune['lora_targets'])}: "
                 f"{trainable} trainable" if "lora_rank" in tune
                 else f"; {tune['trainable']:g} of it trainable ({trainable})")
    lines = [
        f"phalanx plan: {what}",
        f"  {s['world_size']} x {s['gpu']} ({_mem(s['gpu_memory_bytes'], u)} {u}) on "
        f"{s['nodes']} node(s); {s['precision']}, {s['optimizer']}"
        f"{', step in backward' if s.get('step_in_backward') else ''}"
        f"{', nf4 base' if s.get('base_dtype') == 'nf4' else ''}"
        f"{f', offload={offload!r}' if offload else ''}; micro-batch {s['batch']} x "
        f"{s['seq']} tokens, grad-accum {s['grad_accum']}, activation checkpointing "
        f"{'on' if s['activation_checkpointing'] else 'off'}"
        f"{', sliced loss' if s.get('sliced_loss') else ''}",
        "",
    ]
    width = 34
    col = 11

    def row(label, values):
        lines.append(f"  {label:<{width}}" + "".join(f"{v:>{col}}" for v in values))

    row(f"memory per device ({u} = {scale_name} B)", names)
    for label, key in (("parameters", "params_bytes"), ("gradients", "grads_bytes"),
                       ("optimizer state", "optimizer_bytes"),
                       ("activations", "activations_bytes"),
                       ("buffers (grad pool, comm)", "buffers_bytes"),
                       ("optimizer step working memory", "step_working_bytes"),
                       ("total (peak)", "total_bytes")):
        row(label, [_mem(getattr(p, key), u) for p in r.strategies.values()])
    row("  peak at", [{"backward start": "bwd start", "end of backward": "bwd end",
                       "optimizer step": "opt step"}[p.peak_at] for p in r.strategies.values()])
    if offload:
        row("host memory per node (pinned)", [_mem(p.host_bytes_per_node, u)
                                              for p in r.strategies.values()])
    row(f"fits in {_mem(s['gpu_memory_bytes'], u)} {u}"
        + (f" + {_mem(s['host_memory_bytes'], u)} host" if s.get("host_memory_bytes") else ""),
        ["yes" if p.fits_with_headroom else ("tight" if p.fits else "NO")
         for p in r.strategies.values()])
    lines.append("")
    bw = s["bandwidth_GBps"]
    row(f"time per step (ring at {bw:g} GB/s)", names)
    row(f"communication per device ({u})", [_mem(p.comm_bytes_per_step, u)
                                            for p in r.strategies.values()])
    row("communication time", [format_seconds(p.comm_time_s) for p in r.strategies.values()])
    row(f"compute ({s['mfu']:.0%} of {s['peak_tflops']:g} TFLOP/s)",
        [format_seconds(p.compute_time_s) for p in r.strategies.values()])
    if offload:
        row(f"host link ({s['host_link_GBps']:g} GB/s), per device",
            [format_seconds(p.host_transfer_s) for p in r.strategies.values()])
        row(f"host step ({s['host_memory_GBps']:g} GB/s memory)",
            [format_seconds(p.host_step_s) for p in r.strategies.values()])
    row("step time, overlapped", [format_seconds(p.step_time_s) for p in r.strategies.values()])
    row("step time, no overlap", [format_seconds(p.step_time_no_overlap_s)
                                  for p in r.strategies.values()])
    row("scaling efficiency", [f"{p.scaling_efficiency:.0%}" for p in r.strategies.values()])
    lines.append("")
    if r.link is not None:
        lines.extend(r.link.lines())
        lines.append("")
    lines.append(f"recommended: {r.recommended or 'none'}: {r.reason}")
    if r.alternatives:
        lines.append("what fits instead (the same plan with the options named changed):")
        lines.extend(f"  - {a.line}" for a in r.alternatives)
    if r.notes:
        lines.append("notes:")
        lines.extend(f"  - {n}" for n in r.notes)
    return "\n".join(lines)
