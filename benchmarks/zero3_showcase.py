"""A model whose replicated training state does not fit this machine trains under zero3.

    .venv/bin/python benchmarks/zero3_showcase.py          # ~1.0B parameters, 2 ranks, CPU

The model: 30 residual blocks of Linear 2048 -> 8192 -> 2048 (1.007B parameters), built on
the meta device (no rank ever holds an fp32 AdamW state of 16 bytes per parameter: 16 GB per
rank, 32 GB for 2 ranks under ddp, on a 24 GiB machine), prepared with strategy="zero3", and
trained a few steps on a batch of 8 x 2048 per rank. Printed: the planner's verdict for ddp
and its zero3 prediction for a rank with half the machine's memory, and each rank's measured
peak resident memory (VmHWM) after prepare (materialising only the rank's shards) and after
training, and step time. Not a test: it takes minutes and most of the
machine's memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))

from peak_rss import _status

import phalanx as px
from phalanx.testing import run_ranks


class Wide(nn.Module):
    def __init__(self, blocks: int, d: int, hidden: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(),
                                                  nn.Linear(hidden, d)) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def train_rank(blocks, d, hidden, steps, rows):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Wide(blocks, d, hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    began = time.perf_counter()
    model, optimizer = px.prepare(model, optimizer, strategy="zero3")
    prepared = time.perf_counter() - began
    prepare_peak = _status("VmHWM")  # materialised from the meta build: the masters, 4 Psi / N
    times = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + px.rank())
        x = torch.randn(rows, d, generator=g)
        start = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return {"peak": _status("VmHWM"), "prepare_peak": prepare_peak, "prepare_s": prepared,
            "steps_s": times}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args(argv)
    ranks = 2
    params = args.blocks * (2 * args.d * args.hidden + args.d + args.hidden)
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_rank = machine // ranks
    with torch.device("meta"):  # the planner reads the engine's units and roots from it
        described = Wide(args.blocks, args.d, args.hidden)
    plan = px.plan(described, gpus=ranks, precision="fp32", optimizer="adamw", backend="gloo",
                   gpu_memory=per_rank, strategy="all", batch=args.rows,
                   input_shape=str(args.d))
    print(f"{params / 1e9:.3f}B parameters, fp32 AdamW, {ranks} ranks on a machine with "
          f"{machine / 2**30:.1f} GiB ({per_rank / 2**30:.1f} GiB per rank)")
    for strategy in ("ddp", "zero3"):
        p = plan[strategy]
        print(f"  phalanx plan, {strategy}: {p.model_states_bytes / 2**30:.1f} GiB of model "
              f"states per rank, {p.total_bytes / 2**30:.1f} GiB at the peak: "
              f"{'fits' if p.fits else 'does not fit'}")
    sys.stdout.flush()
    results = run_ranks(train_rank, ranks,
                        args=(args.blocks, args.d, args.hidden, args.steps, args.rows),
                        timeout=3600)
    for rank, r in enumerate(results):
        steps = ", ".join(f"{t:.1f}" for t in r["steps_s"])
        print(f"  rank {rank}: peak resident {r['peak'] / 2**30:.2f} GiB (planned "
              f"{plan['zero3'].total_bytes / 2**30:.2f}); after prepare "
              f"{r['prepare_peak'] / 2**30:.2f} GiB (masters {4 * params / ranks / 2**30:.2f}, "
              f"whole model {4 * params / 2**30:.2f}); prepare {r['prepare_s']:.1f} s; "
              f"steps {steps} s")


if __name__ == "__main__":
    main()
