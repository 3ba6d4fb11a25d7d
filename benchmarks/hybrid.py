"""Hybrid sharding over a slow link between nodes, on a cluster of namespaces on this machine
(phalanx.testing.cluster): zero3 flat, zero3 with shard_size=2, and FSDP2's HSDP.

    .venv/bin/python benchmarks/hybrid.py                       # needs root (ip netns, tc)
    .venv/bin/python benchmarks/hybrid.py --rate 1gbit --rounds 5 --width 1024 --blocks 8
    .venv/bin/python benchmarks/hybrid.py --local --rounds 1    # 4 local ranks, no link

Two nodes of two ranks each (gloo, one thread per rank), joined through a switch by a link of
`--rate` (tc's token bucket, both directions); each node's launcher is `phalanx run --nnodes 2
--node-rank R`. The model is `--blocks` residual MLP blocks of `--width` (Linear, GELU,
Linear), AdamW, `--batch` rows per rank. Every competitor trains its own copy of the same
blocks in the same processes, taking turns in rotating order: phalanx zero3 over all 4 ranks,
phalanx zero3 with shard_size=2 (shard within a node, replicate across), and FSDP2's HSDP
(`fully_shard` per block and on the root, over a 2 x 2 DeviceMesh: replicate across nodes,
shard within). A step's time is the slowest rank's; the table gives medians over rounds and
the bytes phalanx's step report counts within and across groups.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
COMPETITORS = ("zero3 flat", "zero3 shard_size=2", "FSDP2 HSDP")


def make(width: int, blocks: int) -> torch.nn.Module:
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(width, 2 * width)
            self.down = torch.nn.Linear(2 * width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    return Net()


def _hsdp(model, world: int, shard: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(rounds: int, steps: int, width: int, blocks: int, batch: int) -> None:
    import torch.distributed as dist

    import phalanx as px

    px.init()
    torch.set_num_threads(1)
    world = px.world_size()
    runs = {}
    for name in COMPETITORS:
        model = make(width, blocks)
        if name == "FSDP2 HSDP":
            model = _hsdp(model, world, 2)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            model, opt = px.prepare(model, opt, strategy="zero3",
                                    shard_size=2 if "shard_size" in name else None)
        runs[name] = (model, opt)
    times = {name: [] for name in COMPETITORS}
    sent = {}
    for r in range(rounds + 1):  # round 0 warms up
        order = COMPETITORS[r % 3:] + COMPETITORS[:r % 3]
        for name in order:
            model, opt = runs[name]
            step_times = []
            for i in range(steps):
                g = torch.Generator().manual_seed(1000 * i + px.rank())
                x = torch.randn(batch, width, generator=g)
                dist.barrier()
                start = time.perf_counter()
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                step_times.append(elapsed.item())
            if r > 0:
                times[name].append(statistics.median(step_times))
            if name != "FSDP2 HSDP":
                stats = px.step_stats(model)
                sent[name] = [stats.get("intra_group_bytes", 0), stats.get("inter_group_bytes", 0)]
    if px.rank() == 0:
        print("RESULT " + json.dumps({"times": times, "sent": sent}), flush=True)
    px.shutdown()


def _print(result: dict, label: str) -> None:
    flat = statistics.median(result["times"]["zero3 flat"])
    print(f"{'link':8} {'competitor':20} {'step s':>7} {'vs flat':>8} {'within MB':>10} "
          f"{'across MB':>10}")
    for name in COMPETITORS:
        t = statistics.median(result["times"][name])
        within, across = result["sent"].get(name, [0, 0])
        print(f"{label:8} {name:20} {t:7.3f} {flat / t:8.2f} {within / 1e6:10.2f} "
              f"{across / 1e6:10.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--local", action="store_true",
                        help="4 ranks on this machine, no shaped link (checks that it runs)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--width",
             str(args.width), "--blocks", str(args.blocks), "--batch", str(args.batch)]
    if args.worker:
        worker(args.rounds, args.steps, args.width, args.blocks, args.batch)
        return
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    print(f"2 nodes x 2 ranks, {args.blocks} blocks of width {args.width}, AdamW, "
          f"{args.batch} rows per rank")
    if args.local:
        done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "4", str(HERE),
                               "--worker", *shape], capture_output=True, text=True,
                              timeout=1800, env={**os.environ})
        nodes = [done]
        label = "local"
    else:
        from phalanx.testing.cluster import Cluster, unavailable

        reason = unavailable()
        if reason is not None:
            print(f"skipped: {reason}")
            return
        with Cluster(nodes=2, rate=None if args.rate == "none" else args.rate) as cluster:
            nodes = cluster.launch([str(HERE), "--worker", *shape], nproc_per_node=2,
                                   timeout=1800)
        label = args.rate
    for node, done in enumerate(nodes):
        if done.returncode != 0:
            raise SystemExit(f"node {node} failed:\n{done.stderr[-3000:]}")
    line = next(l for l in nodes[0].stdout.splitlines() if "RESULT " in l)
    _print(json.loads(line.split("RESULT ", 1)[1]), label)


if __name__ == "__main__":
    main()
