"""Scaling: the same model at world sizes 1, 2, 4 (weak scaling: a fixed batch per rank).

    .venv/bin/python benchmarks/scaling.py                     # CPU, gloo; writes docs/scaling.png
    .venv/bin/python benchmarks/scaling.py --worlds 1,2 --model transformer

For each world size every strategy trains its own copy of the model on the same ranks, taking
turns step by step; throughput is samples per second over all ranks (the slowest rank's step
time), and scaling efficiency is throughput(N) / (N x throughput(1)). On a machine with fewer
cores than ranks x threads the ranks share cores and efficiency falls for that reason alone: the
table says how many cores there were.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from ddp import batch_for, loss_for, make

import phalanx as px
from phalanx.testing import run_ranks

STRATEGIES = ("ddp", "zero1", "zero2")


def bench_rank(model_name, steps, warmup):
    torch.set_num_threads(1)
    built = {}
    for strategy in STRATEGIES:
        model = make(model_name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        built[strategy] = px.prepare(model, opt, strategy=strategy)
    times = {s: [] for s in STRATEGIES}
    for i in range(-warmup, steps):
        for strategy in STRATEGIES[i % 3:] + STRATEGIES[:i % 3]:
            model, opt = built[strategy]
            x, y = batch_for(model_name, px.rank(), i)
            if px.world_size() > 1:
                dist.barrier()
            start = time.perf_counter()
            loss_for(model_name, model, x, y).backward()
            opt.step()
            opt.zero_grad()
            elapsed = torch.tensor([time.perf_counter() - start])
            if px.world_size() > 1:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= 0:
                times[strategy].append(elapsed.item())
    return {s: statistics.median(t) for s, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--plot", default=str(Path(__file__).parent.parent / "docs" /
                                              "scaling.png"))
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    batch = batch_for(args.model, 0, 0)[0].shape[0]
    results = {}
    for world in worlds:
        results[world] = run_ranks(bench_rank, world, args=(args.model, args.steps,
                                                            args.warmup), timeout=3000)[0]
    print(f"{args.model}, batch {batch} per rank, CPU ({os.cpu_count()} cores), gloo, 1 thread "
          f"per rank, torch {torch.__version__}; median of {args.steps} steps\n")
    print("| strategy | " + " | ".join(f"{w} rank{'s' if w > 1 else ''}: samples/s (eff.)"
                                       for w in worlds) + " |")
    print("| --- |" + " --- |" * len(worlds))
    base = worlds[0]
    for strategy in STRATEGIES:
        cells = []
        for world in worlds:
            throughput = world * batch / results[world][strategy]
            one = base * batch / results[base][strategy] / base
            cells.append(f"{throughput:.0f} ({throughput / (world * one):.2f})")
        print(f"| {strategy} | " + " | ".join(cells) + " |")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for strategy in STRATEGIES:
            ax.plot(worlds, [w * batch / results[w][strategy] for w in worlds], "o-",
                    label=strategy)
        one = batch / min(results[base].values()) / base
        ax.plot(worlds, [w * one for w in worlds], "k:", label="perfect scaling")
        ax.set_xlabel("ranks")
        ax.set_ylabel("samples/s, all ranks")
        ax.set_xticks(worlds)
        ax.set_title(f"{args.model}: throughput by world size ({os.cpu_count()} CPU cores)")
        ax.legend(fontsize="small")
        fig.tight_layout()
        os.makedirs(os.path.dirname(args.plot), exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
