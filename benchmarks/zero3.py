"""phalanx zero3 against PyTorch's FSDP2 (`fully_shard`) and phalanx zero2: memory and time.

    .venv/bin/python benchmarks/zero3.py                 # 2 ranks, CPU, gloo, 1 thread each
    .venv/bin/python benchmarks/zero3.py --rounds 9 --steps 4

The model is the MLP of benchmarks/ddp.py: 6 blocks (an nn.ModuleList) of Linear 512 -> 2048
-> 512, 12.6M parameters, fp32, AdamW, a batch of 32 x 512 per rank. FSDP2 wraps each block,
then the model (PyTorch's recipe); phalanx zero3 finds the same blocks by itself.

Time: every competitor trains its own copy in the same processes, taking turns in rotating
order; a step is the slowest rank's; the median over rounds.

Memory, each competitor in fresh processes: the rise of the process's peak resident memory
(VmHWM, reset with /proc/self/clear_refs after 2 warm-up steps) over 3 steps, from just before
the model is built; beside the ZeRO formula for the state kept between steps (fp32 AdamW,
Psi parameters, N ranks: zero3 16 Psi / N, zero2 (4 + 12/N) Psi), the largest over ranks.
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
from peak_rss import _reset_peak, _status

import phalanx as px
from phalanx.testing import run_ranks

NAMES = ("phalanx zero3", "zero3 no prefetch", "FSDP2", "phalanx zero2")


def build(name):
    model = make("mlp")
    if name == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "zero3 no prefetch":
        return px.prepare(model, optimizer, strategy="zero3", prefetch=0)
    return px.prepare(model, optimizer, strategy=name.split()[1])


def step(model, optimizer, i):
    x, y = batch_for("mlp", px.rank(), i)
    loss_for("mlp", model, x, y).backward()
    optimizer.step()
    optimizer.zero_grad()


def time_rank(rounds, steps, warmup):
    torch.set_num_threads(1)
    px.init()
    built = {name: build(name) for name in NAMES}
    times = {name: [] for name in NAMES}
    i = 0
    for r in range(-warmup, rounds):
        k = r % len(NAMES)
        order = NAMES[k:] + NAMES[:k]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(*built[name], i)
                i += 1
            elapsed = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if r >= 0:
                times[name].append(elapsed.item())
    return {name: statistics.median(t) for name, t in times.items()}


def memory_rank(name):
    torch.set_num_threads(1)
    px.init()
    for i in range(6):  # the batches exist before the baseline
        batch_for("mlp", px.rank(), i)
    baseline = _status("VmRSS")
    model, optimizer = build(name)
    for i in range(2):
        step(model, optimizer, i)
    _reset_peak()
    for i in range(2, 5):
        step(model, optimizer, i)
    return _status("VmHWM") - baseline


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    world = 2
    params = sum(p.numel() for p in make("mlp").parameters())
    print(f"{world} ranks, CPU, gloo, 1 thread per rank, torch {torch.__version__}; MLP "
          f"{params / 1e6:.1f}M parameters, fp32 AdamW")
    med = run_ranks(time_rank, world, args=(args.rounds, args.steps, args.warmup),
                    timeout=3000)[0]
    print(f"\nstep time, median of {args.rounds} rounds x {args.steps} steps, interleaved")
    print(f"{'competitor':18s} {'ms':>8s} {'/ FSDP2':>8s} {'/ zero2':>8s}")
    for name in NAMES:
        print(f"{name:18s} {1e3 * med[name]:8.1f} {med[name] / med['FSDP2']:8.3f} "
              f"{med[name] / med['phalanx zero2']:8.3f}")
    formula = {"phalanx zero3": 16 / world, "zero3 no prefetch": 16 / world,
               "FSDP2": 16 / world, "phalanx zero2": 4 + 12 / world}
    print("\npeak resident memory rise over 3 steps (largest rank), each in fresh processes")
    print(f"{'competitor':18s} {'MB':>8s} {'formula MB':>11s} {'/ formula':>10s} {'/ FSDP2':>8s}")
    rises = {name: max(run_ranks(memory_rank, world, args=(name,), timeout=600))
             for name in NAMES}
    for name in NAMES:
        f = formula[name] * params
        print(f"{name:18s} {rises[name] / 1e6:8.1f} {f / 1e6:11.1f} {rises[name] / f:10.2f} "
              f"{rises[name] / rises['FSDP2']:8.3f}")


if __name__ == "__main__":
    main()
