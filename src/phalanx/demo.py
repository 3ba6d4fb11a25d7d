"""Train a small classifier with data parallelism, on CPU, in about half a minute.

    phalanx demo                          # 2 processes, strategy ddp
    phalanx demo -n 3 --strategy zero2    # 3 processes, sharded optimizer state and gradients
    phalanx demo --strategy zero3         # parameters sharded too, gathered as they compute
    python -m phalanx.demo                # the same script as one plain process

The data is embedded: three interleaved spirals in the plane, generated from a fixed seed, so
nothing is downloaded. Each epoch prints the training loss (averaged over all ranks) and the
accuracy on a held-out set, counted exactly once per sample across ranks. The global batch is
the same whatever the number of processes, so the numbers barely change with -n.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from .spec import precisions as _precisions
from .spec.strategies import STRATEGIES

GLOBAL_BATCH = 64
PRECISIONS = tuple(_precisions.PRECISIONS)  # the one vocabulary (precisions.py)


def spirals(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """`n` points on three noisy spiral arms; label = arm."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    t = torch.rand(n, generator=g) * 3.0 + 0.3
    angle = t * 2.2 + labels * (2 * math.pi / 3)
    r = t / 3.3
    points = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1)
    points += 0.035 * torch.randn(n, 2, generator=g)
    return torch.utils.data.TensorDataset(points, labels)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(),
                         nn.Linear(128, 3))


def train(strategy: str = "ddp", precision: str = "fp32", epochs: int = 12) -> float:
    import phalanx as px

    px.init()
    torch.manual_seed(0)
    train_set, test_set = spirals(3000, seed=1), spirals(600, seed=2)
    batch = max(1, GLOBAL_BATCH // px.world_size())
    train_loader = px.data_loader(train_set, batch, shuffle=True, seed=0)
    test_loader = px.data_loader(test_set, 128, shuffle=False)

    device = px.device()  # where the prepared model computes (and returns its outputs)
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    net, optimizer = px.prepare(net, optimizer, strategy=strategy, precision=precision)
    if px.is_main():
        print(f"phalanx demo: {px.world_size()} process(es), strategy={strategy}, "
              f"precision={precision}, global batch {batch * px.world_size()}", flush=True)

    accuracy = 0.0
    start = time.perf_counter()
    for epoch in range(epochs):
        train_loader.sampler.set_epoch(epoch)
        net.train()
        loss_sum, count = 0.0, 0
        for x, y in px.progress(train_loader, desc=f"epoch {epoch + 1}", leave=False):
            # px.data_loader already puts batches on px.device(); the targets are moved here
            # too so the loss never meets a CPU `y` on a GPU (a no-op where y is there)
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss_sum += loss.item() * len(y)
            count += len(y)
            # the step report of every rank (a small collective), written by rank 0
            px.log({"loss": loss.item(), **px.step_stats(net, all_ranks=True)}, every=0)
        sums, counts = zip(*px.gather((loss_sum, count)))  # every rank's, in rank order
        mean_loss = sum(sums) / sum(counts)

        net.eval()
        correct = []
        with torch.no_grad():
            for x, y in test_loader:
                hits = (net(x).argmax(dim=1) == y.to(device, non_blocking=True)).float()
                correct.append(px.gather_for_metrics(hits, test_loader))
        seen = torch.cat(correct)
        accuracy = seen.mean().item()
        if px.is_main():
            print(f"epoch {epoch + 1:2d}  train loss {mean_loss:.4f}  "
                  f"test accuracy {100 * accuracy:5.1f}% ({len(seen)} samples)", flush=True)
    if px.is_main():
        from .observe.metrics import close, run_dir
        from .observe.report_cli import read_metrics, summary

        close()
        print(f"done in {time.perf_counter() - start:.1f} s\n"
              f"{summary(read_metrics(run_dir()))}\n"
              f"plots: phalanx report {run_dir()}", flush=True)
    px.shutdown()
    return accuracy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc", type=int, default=2, help="processes (default 2)")
    # choices: a bad name is one argparse error here, before any worker starts
    parser.add_argument("--strategy", default="ddp", choices=STRATEGIES, metavar="STRATEGY",
                        help="ddp, zero1, zero2 or zero3 (default ddp)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS, metavar="PRECISION",
                        help="fp32, bf16, fp16 or bf16-true (default fp32)")
    parser.add_argument("--epochs", type=int, default=12, help="epochs (default 12)")


def main(args: argparse.Namespace) -> int:
    from .cli import main as cli_main

    return cli_main(["run", "-n", str(args.nproc), "-m", "phalanx.demo",
                     "--strategy", args.strategy, "--precision", args.precision,
                     "--epochs", str(args.epochs)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m phalanx.demo")
    add_arguments(parser)
    ns = parser.parse_args()
    train(ns.strategy, ns.precision, ns.epochs)
    sys.exit(0)
