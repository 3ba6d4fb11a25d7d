"""`phalanx report RUN_DIR`: plots and a one-screen summary of a run's logged step reports.

Reads RUN_DIR/metrics.csv (written by `px.log`, see observe/metrics.py) and writes, next to it:

    step_time.png   the step's wall time broken down (forward, backward, optimizer, data, other)
                    over the steps, with the exposed communication drawn over it
    overlap.png     communication in flight and exposed per step, and the overlap
    memory.png      resident memory per rank (rank0/rss_mb... when the steps were logged with
                    px.step_stats(model, all_ranks=True)), else rank 0's
    loss.png        `loss` over the steps, when it was logged
    summary.txt     medians of the step report, the throughput, bytes per step, the slowest
                    rank, and `phalanx plan`'s prediction for the run (RUN_DIR/run.json)
                    beside what was measured (also printed)

Plots need matplotlib (`pip install 'phalanx[report]'`).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
from collections import Counter, defaultdict

from ..engine.policy import POLICIES, SHARD

__all__ = ["add_arguments", "main", "read_metrics", "summary", "plan_for_run"]

PARTS = ("forward_s", "backward_s", "optimizer_s", "data_s", "other_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by px.log")
    parser.add_argument("--skip", type=int, default=1, metavar="K",
                        help="leave out the first K logged steps from the medians (warm-up; "
                             "default 1)")


def read_metrics(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """name -> [(step, value)] from RUN_DIR/metrics.csv, in the order written."""
    from ..spec.command_error import CommandError

    path = os.path.join(run_dir, "metrics.csv")
    if not os.path.exists(path):
        raise CommandError(f"{path} does not exist: give the run directory that px.log wrote "
                           "(PHALANX_RUN_DIR, or runs/phalanx-... under the working directory)")
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None or header[:3] != ["step", "name", "value"]:
            raise CommandError(f"{path} is not a metrics file of px.log (its header is "
                               f"{header!r}, expected step,name,value,seconds)")
        for row in rows:
            try:
                series[row[1]].append((int(row[0]), float(row[2])))
            except (ValueError, IndexError):
                continue  # a line cut short by a crash
    return dict(series)


def _median(series, name, skip):
    values = [v for _, v in series.get(name, [])][skip:]
    return statistics.median(values) if values else None


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def summary(series: dict, skip: int = 1) -> str:
    steps = len(series.get("wall_s", []))
    if not steps:
        names = ", ".join(sorted(series)) or "none"
        return (f"no step report in this run (metrics logged: {names}); log "
                "px.step_stats(model) with px.log to get one")
    med = {name: _median(series, name, skip) for name in
           ("wall_s", "comm_s", "exposed_comm_s", "overlap", "samples_per_s", "tokens_per_s",
            "comm_bytes", "peak_rss_mb", *PARTS)}
    wall = med["wall_s"]
    lines = [f"{steps} steps logged; medians over steps {skip + 1}-{steps}:",
             f"  step          {1e3 * wall:9.1f} ms"]
    for part in PARTS:
        if med[part] is not None:
            lines.append(f"  {part[:-2]:13s} {1e3 * med[part]:9.1f} ms  "
                         f"{100 * med[part] / wall:5.1f}%")
    if med["comm_s"] is not None:
        lines.append(f"  communication {1e3 * med['comm_s']:9.1f} ms in flight, "
                     f"{1e3 * med['exposed_comm_s']:.1f} ms exposed, overlap "
                     f"{100 * med['overlap']:.0f}%")
    if med["comm_bytes"]:
        # per kind: the mean over the steps (a kind issued in a few steps only, such as an
        # evaluation's gathers, counts for what it adds per step)
        per_kind = [f"{name.split('/')[0]} {_size(sum(v for _, v in values) / steps)}"
                    for name, values in sorted(series.items()) if name.endswith("/bytes")]
        lines.append(f"  bytes/step    {_size(med['comm_bytes']):>12s} median "
                     f"(mean per kind: {', '.join(per_kind)})")
    if med["samples_per_s"]:
        lines.append(f"  throughput    {med['samples_per_s']:9.1f} samples/s per rank"
                     + (f", {med['tokens_per_s']:.0f} tokens/s" if med["tokens_per_s"] else ""))
    if "slowest_rank" in series:
        counts = Counter(int(v) for _, v in series["slowest_rank"][skip:])
        rank, n = counts.most_common(1)[0]
        skew = _median(series, "skew_s", skip) or 0.0
        lines.append(f"  slowest rank  {rank} in {n} of {sum(counts.values())} steps "
                     f"(median skew {1e3 * skew:.1f} ms)")
    if med["peak_rss_mb"] is not None:
        lines.append(f"  peak memory   {max(v for _, v in series['peak_rss_mb']):9.0f} MB "
                     "resident (rank 0)")
    if "loss" in series:
        lines.append(f"  loss          {series['loss'][0][1]:.4g} -> {series['loss'][-1][1]:.4g}")
    return "\n".join(lines)


def plan_for_run(run: dict):
    """`phalanx plan` for a run, from what px.prepare recorded of it (RUN_DIR/run.json): its
    StrategyPlan. A zero3 run also recorded its roots and gathering options, which say what
    stays gathered from forward into backward (engine/zero3_roots.py's `engine_roots`)."""
    from ..planner import plan
    from ..planner.model_desc import from_count

    desc = from_count(run["trainable_params"])
    zero3 = run.get("zero3") or {}
    desc.zero3_roots = zero3.get("roots")
    return plan(desc, gpus=run["world"], strategy=run["strategy"],
                precision=run["precision"],  # one vocabulary: phalanx.spec.precisions
                optimizer=run.get("optimizer") or "adamw",
                backend="gloo" if run["backend"] == "gloo" else "nccl",
                bucket_mb=run["bucket_mb"],
                comm_dtype={"bfloat16": "bf16", "float16": "fp16"}.get(
                    str(run.get("comm_dtype")).replace("torch.", "")),
                prefetch=zero3.get("prefetch", 1),
                max_gathered_mb=zero3.get("max_gathered_mb"),
                reshard_after_forward=zero3.get("reshard_after_forward", True))[run["strategy"]]


def against_plan(run_dir: str, series: dict, skip: int = 1) -> str | None:
    """`phalanx plan`'s prediction for the run's model, strategy and world size (RUN_DIR/
    run.json, written by px.log from what px.prepare saw) beside the measured medians."""
    path = os.path.join(run_dir, "run.json")
    if not os.path.exists(path) or "wall_s" not in series:
        return None
    import json

    with open(path) as f:
        run = json.load(f)
    try:
        planned = plan_for_run(run)
    except (KeyError, ValueError) as exc:
        return f"(no comparison with phalanx plan: {exc})"
    lines = [f"phalanx plan for this run ({run['trainable_params'] / 1e6:.2f}M parameters, "
             f"{run['strategy']}, {run['precision']}, {run['world']} ranks) against the "
             "measured medians:",
             f"  {'':24s} {'planned':>12s} {'measured':>12s}"]
    for op, nbytes in sorted(planned.comm_payload_bytes.items()):
        measured = _median(series, f"{op}/bytes", skip)
        lines.append(f"  {op + ' bytes/step':24s} {_size(nbytes):>12s} "
                     f"{_size(measured) if measured is not None else '-':>12s}")
    if run.get("device", "cpu").startswith("cuda") and "gpu_peak_allocated_mb" in series:
        peak = max(v for _, v in series["gpu_peak_allocated_mb"])
        lines.append(f"  {'peak memory':24s} {_size(planned.total_bytes):>12s} "
                     f"{_size(peak * 2**20):>12s}")
        lines.append(f"  {'step time':24s} {1e3 * planned.step_time_s:9.1f} ms "
                     f"{1e3 * _median(series, 'wall_s', skip):9.1f} ms (planned for the "
                     "planner's GPU preset)")
    else:
        lines.append("  (memory and time are planned for a GPU; on CPU only the bytes compare)")
    if POLICIES[run["strategy"]].params is SHARD and not run.get("zero3"):
        lines.append("  (this run did not record zero3's roots: backward is planned to gather "
                     "every unit again, where the engine keeps those rooted at the model)")
    return "\n".join(lines)


def plot(series: dict, out_dir: str) -> list[str]:
    """The PNGs of the module's docstring; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "wall_s" in series:
        steps = [s for s, _ in series["wall_s"]]
        fig, ax = plt.subplots(figsize=(8, 4))
        parts = [[1e3 * v for _, v in series[p]] for p in PARTS if p in series]
        labels = [p[:-2] for p in PARTS if p in series]
        ax.stackplot(steps, *parts, labels=labels, alpha=0.8)
        if "exposed_comm_s" in series:
            ax.plot(steps, [1e3 * v for _, v in series["exposed_comm_s"]], "k--",
                    label="exposed communication")
        ax.set_xlabel("step")
        ax.set_ylabel("ms")
        ax.set_title("Where each step's time went")
        ax.legend(loc="upper right", fontsize="small")
        save(fig, "step_time.png")
    if "comm_s" in series:
        steps = [s for s, _ in series["comm_s"]]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot(steps, [1e3 * v for _, v in series["comm_s"]], label="in flight")
        ax.plot(steps, [1e3 * v for _, v in series["exposed_comm_s"]], label="exposed")
        ax.set_xlabel("step")
        ax.set_ylabel("communication, ms")
        right = ax.twinx()
        right.plot(steps, [100 * v for _, v in series["overlap"]], "g:", label="overlap")
        right.set_ylabel("overlap, %")
        right.set_ylim(0, 105)
        ax.set_title("Communication hidden behind compute")
        handles = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper right",
                  fontsize="small")
        save(fig, "overlap.png")
    per_rank = sorted((n for n in series if n.startswith("rank") and n.endswith("/rss_mb")),
                      key=lambda n: int(n[4:].split("/")[0]))
    memory = per_rank or (["rss_mb"] if "rss_mb" in series else [])
    if memory:
        fig, ax = plt.subplots(figsize=(8, 4))
        for name in memory:
            ax.plot([s for s, _ in series[name]], [v for _, v in series[name]],
                    label=name.split("/")[0] if per_rank else "rank 0")
        ax.set_xlabel("step")
        ax.set_ylabel("resident memory, MB")
        ax.set_title("Memory per rank")
        ax.legend(fontsize="small")
        save(fig, "memory.png")
    if "loss" in series:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([s for s, _ in series["loss"]], [v for _, v in series["loss"]])
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("Loss")
        save(fig, "loss.png")
    return written


def main(args: argparse.Namespace) -> int:
    from ..spec.command_error import CommandError

    series = read_metrics(args.run_dir)
    text = summary(series, max(args.skip, 0))
    compared = against_plan(args.run_dir, series, max(args.skip, 0))
    if compared:
        text += "\n" + compared
    with open(os.path.join(args.run_dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    try:
        written = plot(series, args.run_dir)
    except ImportError:
        raise CommandError("the plots need matplotlib: pip install 'phalanx[report]' (the "
                           "summary above was written to summary.txt)") from None
    for path in written:
        print(f"wrote {path}")
    return 0
