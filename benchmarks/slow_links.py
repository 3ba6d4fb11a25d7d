"""Data parallelism over slow links, on a cluster of namespaces on this machine
(phalanx.testing.cluster): step time against the compute-only bound, and bytes on the link.

    .venv/bin/python benchmarks/slow_links.py                  # needs root (ip netns, tc)
    .venv/bin/python benchmarks/slow_links.py --rates 1gbit 10gbit none --rounds 5

Two nodes of one rank each (gloo, one thread per rank), joined through a switch by links of
each `--rates` (tc's token bucket, both directions). Each node's launcher is `phalanx run
--nnodes 2 --node-rank R`, as on a real cluster. The model is the MLP of benchmarks/ddp.py
(12.6M parameters: 50 MB of fp32 gradients a step), AdamW, 32 x 512 per rank. Every
competitor trains its own copy in the same processes, taking turns in rotating order: the
compute-only bound (the same forward, backward and step with no communication), phalanx ddp,
ddp with bf16 communication, and ddp with PowerSGD at rank 4 (compressing from the first
step). A step's time is the slowest rank's; the table gives medians over rounds, the fraction
of the compute-only bound's throughput each reaches, the bytes each sends per step (the step
report), and the bytes node 1's link carried in the whole run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
COMPETITORS = ("compute-only", "ddp", "ddp bf16 comm", "ddp powersgd")


def worker(rounds: int, steps: int) -> None:
    import torch.distributed as dist

    import phalanx as px
    sys.path.insert(0, str(HERE.parent))
    from ddp import batch_for, loss_for, make

    px.init()
    torch.set_num_threads(1)
    runs = {}
    for name in COMPETITORS:
        model = make("mlp")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name != "compute-only":
            comm = torch.bfloat16 if "bf16" in name else None
            compression = px.PowerSGD(rank=4, start_step=0) if "powersgd" in name else None
            model, opt = px.prepare(model, opt, strategy="ddp", comm_dtype=comm,
                                    compression=compression)
        runs[name] = (model, opt)
    times = {name: [] for name in COMPETITORS}
    sent = {}
    for r in range(rounds + 1):  # round 0 warms up
        turn = r % len(COMPETITORS)
        order = COMPETITORS[turn:] + COMPETITORS[:turn]
        for name in order:
            model, opt = runs[name]
            step_times = []
            for i in range(steps):
                dist.barrier()
                start = time.perf_counter()
                x, y = batch_for("mlp", px.rank(), i)
                loss_for("mlp", model, x, y).backward()
                opt.step()
                opt.zero_grad()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                step_times.append(elapsed.item())
            if r > 0:
                times[name].append(statistics.median(step_times))
            if name != "compute-only":
                sent[name] = px.step_stats(model).get("comm_bytes", 0)
    if px.rank() == 0:
        print("RESULT " + json.dumps({"times": times, "sent": sent}), flush=True)
    px.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.steps)
        return
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    from phalanx.testing.cluster import Cluster, unavailable

    reason = unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        return
    print("2 nodes x 1 rank, 12.6M MLP (50 MB fp32 gradients), AdamW, 32 x 512 per rank")
    print(f"{'link':8} {'competitor':14} {'step s':>7} {'of bound':>9} {'sent MB/step':>13}")
    for rate in args.rates:
        with Cluster(nodes=2, rate=None if rate == "none" else rate) as cluster:
            before = cluster.link_bytes(1)
            nodes = cluster.launch([str(HERE), "--worker", "--rounds", str(args.rounds),
                                    "--steps", str(args.steps)], timeout=1800)
            link = sum(a - b for a, b in zip(cluster.link_bytes(1), before))
        for node, done in enumerate(nodes):
            if done.returncode != 0:
                raise SystemExit(f"node {node} failed:\n{done.stderr[-3000:]}")
        line = next(l for l in nodes[0].stdout.splitlines() if "RESULT " in l)
        result = json.loads(line.split("RESULT ", 1)[1])
        bound = statistics.median(result["times"]["compute-only"])
        for name in COMPETITORS:
            t = statistics.median(result["times"][name])
            sent = result["sent"].get(name, 0) / 1e6
            print(f"{rate:8} {name:14} {t:7.3f} {bound / t:9.2f} {sent:13.1f}", flush=True)
        print(f"{rate:8} node 1's link carried {link / 1e6:.0f} MB in the run", flush=True)


if __name__ == "__main__":
    main()
