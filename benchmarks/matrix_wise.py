"""Step time and optimizer memory of Muon sharded (zero2, each matrix stepped whole on one owner
rank) beside Muon replicated (ddp, every rank steps every matrix) and AdamW sharded (zero2), in
one run.

    .venv/bin/python benchmarks/matrix_wise.py                 # 2 ranks, 7 rounds of 3 steps
    .venv/bin/python benchmarks/matrix_wise.py --rounds 3 --steps 2 --ranks 3

The model: 6 blocks of Linear(512, 2048) and Linear(2048, 512) without bias (12.6M parameters,
all matrices, as Muon requires), fp32, a batch of 64 rows per rank; CPU, gloo, 1 thread per rank.
Competitors, all built in the same processes, which live for the whole run: px.prepare with
("zero2", Muon), ("ddp", Muon), ("zero2", AdamW), ("ddp", AdamW). After a warm-up round, every
round runs each for `--steps` steps in an order rotated by one each round; a competitor's time in
a round is the slowest rank's mean step. Reported: each one's median over rounds, the median over
rounds of the ratios of zero2+Muon to ddp+Muon and to zero2+AdamW in the same round, and each
rank's optimizer-state elements against the formula (Muon: one momentum per element, the matrices
this rank owns; ideal E/N).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))

import phalanx as px
from phalanx.testing import engine_of, run_ranks

COMPETITORS = [("zero2", "muon"), ("ddp", "muon"), ("zero2", "adamw"), ("ddp", "adamw")]


def make_model(blocks=6, d=512, hidden=2048) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(d, hidden, bias=False), nn.GELU(), nn.Linear(hidden, d, bias=False)]
    return nn.Sequential(*layers)


def build(strategy, optimizer):
    model = make_model()
    opt = torch.optim.Muon(model.parameters(), lr=0.02) if optimizer == "muon" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    return px.prepare(model, opt, strategy=strategy)


def bench_rank(rounds: int, steps: int):
    torch.set_num_threads(1)
    built = {c: build(*c) for c in COMPETITORS}
    x = torch.randn(64, 512)

    def run(c, n):
        model, opt = built[c]
        start = time.perf_counter()
        for _ in range(n):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - start) / n

    for c in COMPETITORS:  # warm-up
        run(c, 1)
    times = []
    for r in range(rounds):
        order = COMPETITORS[r % len(COMPETITORS):] + COMPETITORS[:r % len(COMPETITORS)]
        row = {}
        for c in order:
            px.barrier()
            row[c] = run(c, steps)
        times.append(row)
    model, opt = built["zero2", "muon"]
    state = sum(v.numel() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    wholes = engine_of(model).wholes
    return times, state, sum(w.numel for w in wholes.wholes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args(argv)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"{args.ranks} ranks, CPU ({cpu}), gloo, 1 thread per rank, torch {torch.__version__}; "
          f"{args.rounds} rounds of {args.steps} steps")
    results = run_ranks(bench_rank, args.ranks, args=(args.rounds, args.steps), timeout=3600)
    rounds = [{c: max(r[0][i][c] for r in results) for c in COMPETITORS}
              for i in range(args.rounds)]
    for c in COMPETITORS:
        median = statistics.median(r[c] for r in rounds)
        print(f"  {c[0]:>5} + {c[1]:<5} median step {median:.3f} s")
    for other in (("ddp", "muon"), ("zero2", "adamw")):
        ratios = [r["zero2", "muon"] / r[other] for r in rounds]
        print(f"  zero2+muon / {other[0]}+{other[1]}: median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    total = results[0][2]
    print(f"  Muon state elements per rank under zero2: "
          f"{', '.join(str(r[1]) for r in results)}; ideal E/N = {total / args.ranks:.0f} "
          f"(E = {total}); ddp: {total} on every rank")


if __name__ == "__main__":
    main()
