"""Flat against hybrid on several nodes: `phalanx plan --nodes M --gpus-per-node G`.

The flat layout shards zero1/zero2/zero3 over all M x G ranks, so its rings cross the
inter-node link with every collective. The hybrid layout (shard_size = G, engine/hybrid.py)
shards within a node and sends across nodes only the replicas' average of each rank's reduced
gradient (planner/hybrid.py), at the price of G in place of M x G in the memory formula. Both
are px.plan's figures for the same model and hardware; this module puts them side by side, a
row per layout and strategy, and recommends the fastest row that fits with headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.policy import POLICIES, SHARD
from .api import plan
from .report import StrategyPlan, _mem

__all__ = ["compare_layouts", "LayoutComparison"]


@dataclass
class LayoutRow:
    layout: str             # "flat" or "hybrid"
    strategy: str
    plan: StrategyPlan
    inter_node_bytes: int   # payload handed to collectives that cross nodes, per step and rank


@dataclass
class LayoutComparison:
    nodes: int
    gpus_per_node: int
    rows: list[LayoutRow]
    recommended: LayoutRow | None
    reason: str
    units: str = "GB"

    def row(self, layout: str, strategy: str) -> LayoutRow:
        return next(r for r in self.rows if (r.layout, r.strategy) == (layout, strategy))

    def __str__(self) -> str:
        head = (f"layouts on {self.nodes} nodes x {self.gpus_per_node} GPUs "
                f"(hybrid: shard_size={self.gpus_per_node})")
        lines = [head, f"{'layout':<8}{'strategy':<10}{'memory ' + self.units:>12}"
                       f"{'step':>12}{'across ' + self.units:>16}  fits"]
        for r in self.rows:
            lines.append(f"{r.layout:<8}{r.strategy:<10}{_mem(r.plan.total_bytes, self.units):>12}"
                         f"{r.plan.step_time_s * 1e3:>10.1f}ms"
                         f"{_mem(r.inter_node_bytes, self.units):>16}  "
                         f"{'yes' if r.plan.fits_with_headroom else 'no'}")
        lines.append(f"recommended: {self.reason}")
        return "\n".join(lines)


def compare_layouts(model=None, *, nodes: int, gpus_per_node: int, **options) -> LayoutComparison:
    """px.plan of the flat layout and of shard_size=gpus_per_node, with `options` as px.plan's
    (link or inter_node_bw: the bandwidth between nodes; intra_node_bw: within one)."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 2 \
            or isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) \
            or gpus_per_node < 2:
        raise ValueError(f"comparing layouts takes 2 or more nodes of 2 or more GPUs (got "
                         f"nodes={nodes!r}, gpus_per_node={gpus_per_node!r}): with one node "
                         "or one GPU per node the hybrid layout is the flat one")
    carried = [o.shard_size for o in (options.get("training"), options.get("spec"))
               if o is not None]
    if any(k is not None for k in (options.get("shard_size"), *carried)):
        raise ValueError("compare_layouts sets shard_size itself (the flat layout and "
                         "gpus_per_node): leave shard_size out")
    options.pop("shard_size", None)
    flat = plan(model, gpus=gpus_per_node, nodes=nodes, **options)
    hybrid = plan(model, gpus=gpus_per_node, nodes=nodes, shard_size=gpus_per_node, **options)
    rows = [LayoutRow("flat", s, p, p.intra_group_payload_bytes)
            for s, p in flat.strategies.items()]
    rows += [LayoutRow("hybrid", s, p, p.inter_group_payload_bytes)  # the rows that shard
             for s, p in hybrid.strategies.items() if POLICIES[s].optimizer is SHARD]
    fitting = [r for r in rows if r.plan.fits_with_headroom]
    if fitting:
        best = min(fitting, key=lambda r: (r.plan.step_time_s, r.plan.total_bytes))
        reason = (f"{best.layout} {best.strategy}: the shortest step "
                  f"({best.plan.step_time_s * 1e3:.1f} ms) of the {len(fitting)} rows that fit")
    else:
        best, reason = None, "none fits in memory with headroom: more GPUs, or a smaller batch"
    return LayoutComparison(nodes, gpus_per_node, rows, best, reason, flat.units)
