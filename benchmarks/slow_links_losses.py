"""How far each remedy for slow links trains in the same number of samples: the model, data and
optimizer of benchmarks/slow_links_lm.py, trained longer, losses only.

    .venv/bin/python benchmarks/slow_links_losses.py                    # 960 steps each
    .venv/bin/python benchmarks/slow_links_losses.py --steps 240 --only ddp 'powersgd r4 s10'
    .venv/bin/python benchmarks/slow_links_losses.py --optimizer sgd --only ddp 'powersgd r4 s96'

Losses do not depend on the link (the same steps on the same data), so this runs 2 ranks on
this machine's loopback through `phalanx run -n 2`, not on the cluster of namespaces. The
competitors train one after another from the same initial weights on the same global batches;
every competitor's held-out loss (the mean over ranks on 8 held-out batches; under DiLoCo
the ranks' own weights, which are the synced ones at a multiple of H) is printed at a quarter,
half, three quarters and the end of the run. "one rank alone" is each rank training its own
copy on its own half of every global batch.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
SGD_LR = 0.5  # --optimizer sgd: momentum SGD, as the PowerSGD paper trains


def competitors(px, steps: int, only: list[str] | None = None) -> dict:
    """name -> keyword arguments of px.prepare (None: one rank alone, no communication). Any
    `powersgd rR sS` named in `only` is made too (rank R from step S)."""
    out = {"ddp": {}, "one rank alone": None}
    powersgd = ["powersgd r4 s10", f"powersgd r4 s{steps // 10}", f"powersgd r8 s{steps // 10}"]
    for name in powersgd + [n for n in only or () if re.fullmatch(r"powersgd r\d+ s\d+", n)]:
        rank, start = (int(v[1:]) for v in name.split()[1:])
        out[name] = {"compression": px.PowerSGD(rank=rank, start_step=start)}
    for h, lr, momentum in ((20, 0.7, 0.9), (20, 0.4, 0.9), (20, 0.1, 0.9), (20, 1.0, 0.0),
                            (50, 0.1, 0.9)):
        out[f"diloco H={h} lr{lr} m{momentum}"] = {"strategy": px.DiLoCo(
            sync_every=h, outer_lr=lr, outer_momentum=momentum)}
    return out


def worker(steps: int, only: list[str] | None, optimizer: str) -> None:
    import slow_links_lm as lm
    import torch.distributed as dist
    from gpt import GPT

    import phalanx as px

    px.init()
    torch.set_num_threads(1)
    table, c = lm.successor_table(), lm.config()
    world, rank = px.world_size(), px.rank()
    held_out = [lm.batch(table, seed=10**6 + i) for i in range(8)]
    marks = {steps * k // 4 for k in (1, 2, 3, 4)}
    for name, kwargs in competitors(px, steps, only).items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model = GPT(c)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "adamw" else
               torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9))
        if kwargs is not None:
            model, opt = px.prepare(model, opt, **kwargs)
        began, curve = time.perf_counter(), {}
        for step in range(1, steps + 1):
            x, y = lm.batch(table, seed=(step - 1) * world + rank)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if step in marks:
                with torch.no_grad():
                    mine = torch.tensor([statistics.mean(model(a, b).item() for a, b in held_out)])
                dist.all_reduce(mine)
                curve[step] = mine.item() / world
        if rank == 0:
            print("CURVE " + json.dumps({"name": name, "curve": curve,
                                         "seconds": time.perf_counter() - began}), flush=True)
    px.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=960)
    parser.add_argument("--only", nargs="+", metavar="NAME")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(HERE.parent))
        worker(args.steps, args.only, args.optimizer)
        return
    cmd = [sys.executable, "-m", "phalanx", "run", "-n", "2", str(HERE), "--worker",
           "--steps", str(args.steps), "--optimizer", args.optimizer] + (
               ["--only", *args.only] if args.only else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    what = "AdamW lr 1e-3" if args.optimizer == "adamw" else f"SGD lr {SGD_LR} momentum 0.9"
    print(f"2 ranks, GPT 7.9M, {what}, 4 x 64 tokens per rank, {args.steps} steps; "
          "held-out loss at each quarter (and its ratio to ddp's at the end)")
    base = None
    for line in proc.stdout:
        if "CURVE " not in line:
            continue
        result = json.loads(line.split("CURVE ", 1)[1])
        curve = {int(k): v for k, v in result["curve"].items()}
        last = curve[max(curve)]
        base = last if result["name"] == "ddp" else base
        ratio = f"{last / base:6.3f}" if base else "     -"
        print(f"{result['name']:26} " + " ".join(f"{v:6.3f}" for v in curve.values())
              + f"  {ratio}  ({result['seconds']:.0f} s)", flush=True)
    if proc.wait() != 0:
        raise SystemExit("the run failed (its output is above)")


if __name__ == "__main__":
    main()
