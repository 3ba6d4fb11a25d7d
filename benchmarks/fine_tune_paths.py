"""The founding example's paths, small: each one's step time and the bytes it holds beside the
plain zero3 run, 2 ranks, in one run.

    .venv/bin/python benchmarks/fine_tune_paths.py               # 5 rounds of 3 steps
    .venv/bin/python benchmarks/fine_tune_paths.py --rounds 3 --steps 2

The model: benchmarks/bf16_true.py's GPT widened (width 256, 4 blocks: 3.3M parameters), batch
8 x 64 tokens per rank, 2 ranks, CPU, gloo, one thread each. Competitors, all zero3 with AdamW
(lr 3e-4), built in the same two processes: bf16 mixed (the plain run); bf16 mixed with
step_in_backward=True; bf16-true; bf16-true with torchao's AdamW8bit (its step compiled, as
torchao runs it; the compile is paid in the warm-up round); bf16 mixed with
offload="optimizer" (gradient shards to the host in backward). Every round runs each for
`--steps` steps in an order rotated by one; a competitor's time in a round is the slower rank's
mean step. Reported: each one's median step and its ratio to the plain run's in the same round
(median, min, max), and the bytes each holds after a step, by kind: weights and masters,
optimizer state, reduced gradients (what stays from a backward to its step), the host's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

import bf16_true
from bf16_true import GPT, corpus
from gpu_common import state_bytes

import phalanx as px
from phalanx.testing import engine_of, run_ranks

COMPETITORS = ["bf16 mixed", "+ step_in_backward", "bf16-true", "bf16-true + AdamW8bit",
               "bf16 mixed + offload"]


def build(name: str, vocab: int):
    torch.manual_seed(0)
    model = GPT(vocab)
    if name == "bf16-true + AdamW8bit":
        from torchao.optim import AdamW8bit
        opt = AdamW8bit(model.parameters(), lr=3e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    precision = "bf16-true" if name.startswith("bf16-true") else "bf16"
    return px.prepare(model, opt, strategy="zero3", precision=precision,
                      step_in_backward=name == "+ step_in_backward",
                      offload="optimizer" if name.endswith("offload") else None)


def held(model, opt) -> dict:
    engine = engine_of(model)
    weights = sum(u.master.numel() * u.master.element_size() for u in engine.units)
    weights += sum(u.flat.numel() * u.flat.element_size() for u in engine.units
                   if u.flat is not None and u.flat.untyped_storage().size())
    state = state_bytes(opt)
    grads = sum(u.grad_shard.numel() * u.grad_shard.element_size() for u in engine.units
                if u.grad_shard is not None)
    host = sum(u.host_grad.numel() * u.host_grad.element_size() for u in engine.units
               if u.host_grad is not None)
    return {"weights": weights, "state": state, "grads": grads, "host grads": host}


def bench_rank(rounds: int, steps: int):
    torch.set_num_threads(1)
    tokens, vocab = corpus()
    built = {name: build(name, vocab) for name in COMPETITORS}
    r = px.rank()
    g = torch.Generator().manual_seed(1 + r)
    kept = {}

    def run(name, n):
        model, opt = built[name]
        start = time.perf_counter()
        for _ in range(n):
            starts = torch.randint(0, tokens.numel() - 65, (8,), generator=g)
            x = torch.stack([tokens[s:s + 64] for s in starts])
            y = torch.stack([tokens[s + 1:s + 65] for s in starts])
            F.cross_entropy(model(x).float().reshape(-1, vocab), y.reshape(-1)).backward()
            kept[name] = held(model, opt)["grads"]  # reduced gradients kept for the step
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - start) / n

    for name in COMPETITORS:
        run(name, 1)  # warm-up: torchao's compile is paid here
    times = []
    for i in range(rounds):
        order = COMPETITORS[i % len(COMPETITORS):] + COMPETITORS[:i % len(COMPETITORS)]
        row = {}
        for name in order:
            px.barrier()
            row[name] = run(name, steps)
        times.append(row)
    sizes = {}
    for name in COMPETITORS:
        sizes[name] = held(*built[name])
        sizes[name]["grads"] = kept[name]
    return times, sizes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    bf16_true.WIDTH, bf16_true.BLOCKS, bf16_true.HEADS = 256, 4, 4
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"2 ranks, CPU ({cpu}), gloo, 1 thread per rank, torch {torch.__version__}; "
          f"{args.rounds} rounds of {args.steps} steps; zero3")
    results = run_ranks(bench_rank, 2, args=(args.rounds, args.steps), timeout=3600)
    rounds = [{n: max(r[0][i][n] for r in results) for n in COMPETITORS}
              for i in range(args.rounds)]
    sizes = results[0][1]
    print("| path | median step | / plain (min, max) | weights | optimizer state | "
          "gradients kept for the step | on the host |")
    print("|---|---|---|---|---|---|---|")
    mb = 2 ** 20
    for name in COMPETITORS:
        ratios = [row[name] / row["bf16 mixed"] for row in rounds]
        s = sizes[name]
        print(f"| {name} | {statistics.median(row[name] for row in rounds):.3f} s | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}, {max(ratios):.2f}) | "
              f"{s['weights'] / mb:.2f} MB | {s['state'] / mb:.2f} MB | {s['grads'] / mb:.2f} MB "
              f"| {s['host grads'] / mb:.2f} MB |")


if __name__ == "__main__":
    main()
