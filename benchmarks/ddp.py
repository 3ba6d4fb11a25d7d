"""Step time of phalanx against PyTorch DDP and the compute-only bound, interleaved in one run.

    .venv/bin/python benchmarks/ddp.py                 # 2 ranks, CPU, gloo, 1 thread per rank
    .venv/bin/python benchmarks/ddp.py --rounds 9 --steps 5 --models mlp

Every competitor trains its own copy of the same model on the same ranks, in the same process,
on the same batches: phalanx ddp (fp32, and with bf16 communication), phalanx zero1 and zero2,
`torch.nn.parallel.DistributedDataParallel`, and the compute-only bound (the same forward,
backward and AdamW step with no communication at all). Each round runs a few steps of every
competitor in a rotating order; a competitor's step time for the round is the slowest rank's.
The table gives the median over rounds and ratios, since absolute times on a shared machine
drift by 5-10% from run to run while ratios taken side by side hold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import run_ranks


class MLP(nn.Module):
    """6 blocks of Linear 512 -> 2048 -> 512 (12.6M parameters)."""

    def __init__(self, blocks=6, d=512, hidden=2048):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
            for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


class Transformer(nn.Module):
    """4 pre-norm layers, d=256, 4 heads, vocabulary 2000, sequence 64 (4.2M parameters)."""

    def __init__(self, vocab=2000, d=256, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make(model_name):
    torch.manual_seed(0)
    return MLP() if model_name == "mlp" else Transformer()


def batch_for(model_name, rank, step):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    if model_name == "mlp":
        return torch.randn(32, 512, generator=g), torch.randn(32, 512, generator=g)
    tokens = torch.randint(0, 2000, (8, 64), generator=g)
    return tokens, torch.randint(0, 2000, (8, 64), generator=g)


def loss_for(model_name, model, x, y):
    out = model(x)
    if model_name == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


COMPETITORS = {
    "compute-only": None,
    "torch DDP": "torch",
    "phalanx ddp": {"strategy": "ddp"},
    "phalanx ddp unchecked": {"strategy": "ddp", "on_nonfinite": None},
    "phalanx ddp no stats": {"strategy": "ddp", "step_stats": False},
    "phalanx ddp bare": {"strategy": "ddp", "on_nonfinite": None, "step_stats": False},
    "phalanx ddp bf16-comm": {"strategy": "ddp", "comm_dtype": torch.bfloat16},
    "phalanx zero1": {"strategy": "zero1"},
    "phalanx zero2": {"strategy": "zero2"},
}


def build(name, model_name):
    model = make(model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    how = COMPETITORS[name]
    if how == "torch":
        model = nn.parallel.DistributedDataParallel(model)
    elif how is not None:
        model, optimizer = px.prepare(model, optimizer, **how)
    return model, optimizer


def bench_rank(model_name, names, rounds, steps, warmup):
    torch.set_num_threads(1)
    rank = px.rank()
    built = {name: build(name, model_name) for name in names}
    times = {name: [] for name in names}
    step_id = 0
    for r in range(-warmup, rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for name in order:
            model, optimizer = built[name]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                x, y = batch_for(model_name, rank, step_id)
                step_id += 1
                loss_for(model_name, model, x, y).backward()
                optimizer.step()
                optimizer.zero_grad()
            elapsed = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            if r >= 0:
                times[name].append(elapsed.item())
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4, help="steps per competitor per round")
    parser.add_argument("--warmup", type=int, default=1, help="rounds not counted")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--only", default=None, help="comma-separated competitor names")
    args = parser.parse_args(argv)
    names = list(COMPETITORS) if args.only is None else args.only.split(",")
    print(f"{args.ranks} ranks, CPU, gloo, 1 thread per rank, torch {torch.__version__}; "
          f"median of {args.rounds} rounds x {args.steps} steps")
    for model_name in args.models.split(","):
        times = run_ranks(bench_rank, args.ranks,
                          args=(model_name, names, args.rounds, args.steps, args.warmup),
                          timeout=3000)[0]
        med = {name: statistics.median(ts) for name, ts in times.items()}
        params = sum(p.numel() for p in make(model_name).parameters())
        print(f"\n{model_name} ({params / 1e6:.1f}M parameters)")
        print(f"{'competitor':24s} {'step ms':>8s} {'/ torch DDP':>12s} {'/ compute-only':>15s} "
              f"{'/ phalanx ddp':>14s}")
        for name in names:
            row = f"{name:24s} {1e3 * med[name]:8.1f}"
            widths = {"torch DDP": 12, "compute-only": 15, "phalanx ddp": 14}
            for ref, width in widths.items():
                row += f" {med[name] / med[ref]:{width}.3f}" if ref in med else f" {'-':>12s}"
            print(row)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
