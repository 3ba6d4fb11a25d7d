"""`phalanx plan --link 1Gbit`: over the link between nodes, is a step communication-bound,
and what would PowerSGD or DiLoCo change.

[Note: the link report]
The link is the bandwidth between nodes, one direction, per rank's share of it (what
`tc`-shaped Ethernet or a NIC gives). Every strategy's bytes per step are the planner's own
(comm.py: a ring moves 2 (N-1)/N x the payload per all-reduce, (N-1)/N per reduce-scatter or
all-gather), and the time over the link is those bytes / the link's bytes per second. The
verdict compares that time with the step's compute time (the planner's FLOPs at the given
utilisation): communication-bound when communication takes longer than compute, since then no
overlap can hide it.

The what-ifs are for ddp, whose only traffic is the gradient all-reduce:
  PowerSGD rank r (Vogels et al. 2019): each gradient of shape (n, ...) is seen as an n x m
      matrix (m the product of the other dimensions) and sent as two factors of (n + m) r
      elements instead of n m; a tensor that would not shrink (1-D ones, small matrices) is
      sent whole, as torch's PowerSGD hook does. Needs the parameters' shapes.
  DiLoCo sync_every H (Douillard et al. 2023): the ranks average once every H steps, so the
      bytes per step are ddp's divided by H.
  streaming DiLoCo (Douillard et al. 2025): the fragments, delay and 4-bit exchange that hide
      the average behind the inner steps at that H (streaming.py, [Note: planning streaming
      DiLoCo]); the link's latency ("100Mbit+20ms") enters there, once per hop of its
      all-gather. The per-step times above are bandwidth only.
They change the training, not only its speed: see their own pages for what they cost in loss.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from .comm import wire_bytes
from .sizes import format_seconds
from .streaming import StreamingPlan, plan_streaming

__all__ = ["parse_link", "link_latency", "powersgd_elements", "LinkReport", "link_report"]

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_LINK = re.compile(rf"\s*{_NUMBER}\s*([kKmMgGtT]?)(bit/s|bit|bps|B/s|Bps|B)?\s*"
                   rf"(?:\+\s*{_NUMBER}\s*(ms|us|s)?\s*)?")
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _match(value) -> re.Match:
    text = str(value)
    m = _LINK.fullmatch(text)
    if m is None or m.group(3) is None:
        raise ValueError(
            f"link {text!r}: give a number with its unit, bits as Gbit (1Gbit, 100Mbit, "
            "10gbit/s, 1Gbps) or bytes as GB/s (25GB/s), and after a + its latency if any "
            "(100Mbit+20ms); 'Gb' alone is ambiguous")
    if m.group(4) is not None and m.group(5) is None:
        raise ValueError(f"link {text!r}: give the latency with its unit: +20ms, +500us, +0.1s")
    return m


def parse_link(value) -> float:
    """A link's bandwidth in bytes per second, from "1Gbit", "10gbit", "100Mbit/s", "1Gbps"
    (bits: divided by 8) or "25GB/s", "3.1GB" (bytes). Decimal prefixes (k, M, G, T). A
    latency after a + ("100Mbit+20ms") is link_latency's."""
    m = _match(value)
    number = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"link {str(value)!r}: the bandwidth must be positive")
    return number / 8 if m.group(3) in ("bit/s", "bit", "bps") else number


def link_latency(value) -> float:
    """The link's one-way latency in seconds, from what follows a + ("100Mbit+20ms": 0.02;
    none given: 0), as tc's netem delay adds it (phalanx.testing.cluster's delay_ms)."""
    m = _match(value)
    if m.group(4) is None:
        return 0.0
    seconds = float(m.group(4)) * _SECONDS[m.group(5)]
    if not math.isfinite(seconds):
        raise ValueError(f"link {str(value)!r}: the latency must be finite")
    return seconds


def powersgd_elements(shapes, rank: int) -> int:
    """Elements PowerSGD rank `rank` sends for gradients of these shapes (see the Note)."""
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) >= 2:
            n, m = shape[0], numel // shape[0]
            total += min((n + m) * rank, numel)
        else:
            total += numel
    return total


@dataclass
class LinkReport:
    link_bytes_per_s: float
    compute_s: float
    comm_s: dict            # strategy -> seconds of communication per step over the link
    verdicts: dict          # strategy -> one line
    ddp_grad_bytes: int     # the gradient payload of ddp's all-reduce
    powersgd_rank: int
    powersgd_grad_bytes: int | None  # None: no shapes (a bare parameter count)
    powersgd_comm_s: float | None
    sync_every: int
    diloco_comm_s: float
    latency_s: float
    streaming: StreamingPlan

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        rate = self.link_bytes_per_s
        latency = f", {format_seconds(self.latency_s)} latency" if self.latency_s else ""
        out = [f"over the link ({rate * 8 / 1e9:g} Gbit/s = {rate / 1e9:g} GB/s{latency} "
               "between nodes):"]
        out += [f"  {name}: {verdict}" for name, verdict in self.verdicts.items()]
        if self.powersgd_comm_s is not None:
            shrink = self.ddp_grad_bytes / max(self.powersgd_grad_bytes, 1)
            out.append(f"  with PowerSGD rank {self.powersgd_rank} (ddp): "
                       f"{format_seconds(self.powersgd_comm_s)} of communication per step "
                       f"({shrink:.1f}x fewer gradient bytes)")
        else:
            out.append("  with PowerSGD: needs the parameters' shapes (describe the model with "
                       "--config or --model)")
        out.append(f"  with DiLoCo sync_every={self.sync_every} (ddp): "
                   f"{format_seconds(self.diloco_comm_s)} of communication per step "
                   f"(one average every {self.sync_every} steps)")
        out.append(f"  {self.streaming.line()}")
        return out


def verdict(comm_s: float, compute_s: float) -> str:
    kind = "communication-bound" if comm_s > compute_s else "compute-bound"
    return (f"{kind}: {format_seconds(comm_s)} of communication per "
            f"{format_seconds(compute_s)} of compute")


def link_report(shown: dict, ddp, shapes, grad_elem_bytes: int, trainable: int, world: int,
                link_bytes_per_s: float, powersgd_rank: int, sync_every: int,
                latency_s: float = 0.0, master_elem_bytes: int = 4) -> LinkReport:
    """`shown`: the planner's StrategyPlan of each strategy shown; `ddp`: ddp's (report.py);
    `master_elem_bytes`: the masters' element size (DiLoCo's pseudo-gradient dtype)."""
    for value, what in ((powersgd_rank, "powersgd_rank"), (sync_every, "sync_every")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    compute_s = ddp.compute_time_s
    comm_s = {name: p.comm_bytes_per_step / link_bytes_per_s for name, p in shown.items()}
    ddp_bytes = grad_elem_bytes * trainable
    compressed = None if shapes is None else \
        grad_elem_bytes * powersgd_elements(shapes, powersgd_rank)
    return LinkReport(
        link_bytes_per_s=link_bytes_per_s, compute_s=compute_s, comm_s=comm_s,
        verdicts={name: verdict(t, compute_s) for name, t in comm_s.items()},
        ddp_grad_bytes=ddp_bytes, powersgd_rank=powersgd_rank,
        powersgd_grad_bytes=compressed,
        powersgd_comm_s=None if compressed is None
        else wire_bytes("all_reduce", compressed, world) / link_bytes_per_s,
        sync_every=sync_every,
        diloco_comm_s=ddp.comm_bytes_per_step / link_bytes_per_s / sync_every,
        latency_s=latency_s,
        streaming=plan_streaming(None if shapes is None else [math.prod(x) for x in shapes],
                                 trainable, world, link_bytes_per_s, latency_s, compute_s,
                                 sync_every, master_elem_bytes))
