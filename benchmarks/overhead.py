"""What the always-on watching costs a training step: the step report, the non-finite check,
the collective record and the hang watcher.

    .venv/bin/python benchmarks/overhead.py            # 2 ranks, CPU, gloo, both models

Two measurements, in one run per model:

1. The added code, timed where it runs. Every function the step report and the non-finite
   check add to a step (the step clock's calls around forward, backward and optimizer.step(),
   the check of each output's gradient and its slot in the buckets) is wrapped in a timer, and
   its time per step is divided by the median step time. A hang-watcher tick is timed too,
   and divided by its period (it runs on its own thread, once per second by default).
2. Side by side: two copies of the model, one prepared with everything on (the default) and
   one with `step_stats=False, on_nonfinite=None`, take turns step by step on the same
   batches; the ratio of their median step times. On 2 cores this carries the machine's
   5-10% drift, which is why (1) is the figure quoted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from ddp import batch_for, loss_for, make

import phalanx as px
from phalanx.faults import nonfinite
from phalanx.observe import step_report
from phalanx.testing import run_ranks
from phalanx.world import process

WATCHED = [(step_report.StepClock, ["forward_done", "backward_started", "_backward_done",
                                    "step_done"]),
           (nonfinite.NonFiniteWatch, ["note", "signal", "after_backward"])]


def _timed(fn, spent):
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - began
    return wrapper


def bench_rank(model_name, steps, warmup):
    torch.set_num_threads(1)
    spent = [0.0]
    for cls, names in WATCHED:
        for name in names:
            setattr(cls, name, _timed(getattr(cls, name), spent))
    built = {}
    for label, how in (("on", {}), ("off", {"step_stats": False, "on_nonfinite": None})):
        model = make(model_name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        built[label] = px.prepare(model, opt, strategy="ddp", **how)
    times = {"on": [], "off": []}
    added = []
    for i in range(-warmup, steps):
        order = ("on", "off") if i % 2 else ("off", "on")
        for label in order:
            model, opt = built[label]
            x, y = batch_for(model_name, px.rank(), i)
            dist.barrier()
            before = spent[0]
            start = time.perf_counter()
            loss_for(model_name, model, x, y).backward()
            opt.step()
            opt.zero_grad()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= 0:
                times[label].append(elapsed.item())
                if label == "on":
                    added.append(spent[0] - before)
    watch = process.state.world.hang_watch
    tick = None
    if watch is not None:
        n = 200
        began = time.perf_counter()
        for _ in range(n):
            watch._tick()
        tick = ((time.perf_counter() - began) / n, watch.poll)
    return times, added, tick


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default="mlp,transformer")
    args = parser.parse_args(argv)
    print(f"2 ranks, CPU, gloo, 1 thread per rank, torch {torch.__version__}; "
          f"{args.steps} steps per configuration, taking turns")
    for model_name in args.models.split(","):
        results = run_ranks(bench_rank, 2, args=(model_name, args.steps, args.warmup),
                            timeout=3000)
        times = results[0][0]
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        added = max(statistics.median(r[1]) for r in results)
        tick, poll = results[0][2] or (0.0, 1.0)
        print(f"\n{model_name}: step {1e3 * on:.1f} ms with everything on, {1e3 * off:.1f} ms "
              f"without (ratio {on / off:.3f})")
        print(f"  added code per step (slowest rank's median): {1e3 * added:.3f} ms = "
              f"{100 * added / on:.2f}% of the step")
        print(f"  hang watcher: {1e3 * tick:.3f} ms per tick every {poll:.1f} s = "
              f"{100 * tick / poll:.3f}% of one core")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
