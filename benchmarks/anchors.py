"""Memory above the anchors: each strategy's peak resident rise beside its ZeRO formula, with
PyTorch DDP and FSDP2 side by side, on a model whose state dwarfs the process's fixed costs.

    .venv/bin/python benchmarks/anchors.py                    # all six, 2 ranks, CPU, gloo
    .venv/bin/python benchmarks/anchors.py --configs zero3,FSDP2 --phases
    .venv/bin/python benchmarks/anchors.py --account          # where the megabytes are

The model: 8 blocks, each one nn.Linear(4096, 4096) (134.3M parameters), in an nn.Sequential;
fp32, AdamW (as built: on CPU its per-tensor loop), MSE loss on a batch of 8 x 4096 per rank,
2 ranks, gloo, one thread each. FSDP2 is `fully_shard` on each block, then the model (PyTorch's
recipe); phalanx finds the same units by itself (each weight, 64 MiB, is a unit of its own).

Per rank, in fresh processes for every configuration:

  prewarm   the whole configuration runs 2 steps on a tiny model first (torch's lazy imports,
            the kernels' code pages, gloo's first collectives: about 116 MB paid once per
            process whatever the model, see benchmarks/peak_rss.py), then is dropped
  baseline  VmRSS after that and the batches are made; the high-water mark is reset to it
  then      build the model and AdamW, prepare (or wrap), train `--steps` steps (forward,
            backward, optimizer.step(), optimizer.zero_grad())
  rise      VmHWM - baseline, the largest over ranks
  step s    the median over steps 2.. of a rank's step time, the slower rank's (each
            configuration in its own processes, one after the other: compare runs loosely)

Formula (fp32 AdamW, Psi parameters, N ranks; Rajbhandari et al. 2020): ddp and torch DDP
16 Psi, zero1 (8 + 8/N) Psi, zero2 (4 + 12/N) Psi, zero3 and FSDP2 16 Psi / N.

--phases resets the high-water mark around every phase of every step and gives the peak rise
within forward, backward, step and zero_grad. --account samples, at every hook of the step
(each root's forward and backward, each gradient's arrival, the optimizer step), the resident
set beside the storages it can name (parameters' and gathered buffers, fresh and bucketed
gradients, masters, shards, optimizer state, pools), and prints the largest sample with what
each category held then (benchmarks/anchors_account.py). --option passes a px.prepare option
to the phalanx configurations (`--option prefetch=0`).

What remains above the formula at the peak (MiB; a unit is one weight, 64 MiB; --account):

  every config  ~10   the same in torch DDP and FSDP2 (after the steps, at rest): 3.4 MKL's
                      scratch for 4096-wide GEMMs (paid at that shape's first use, which the
                      tiny model never reaches), 2.3 torch's own in one process (autograd's and
                      the heap's small blocks), ~4.4 the process group (gloo's buffers, its
                      threads' malloc arenas)
  ddp     +128  in the step: AdamW's per-tensor loop makes two temporaries of the 64 MiB
                weight it steps (fused=True makes none)
  zero1   +64   in backward, the gradient autograd has just made (copied into the kept
                bucket), and in the step AdamW's two temporaries of a 32 MiB shard piece
  zero2   +128  in backward: the gradient autograd has just made (block k) and block k+1's,
                being all-reduced in the tensor autograd made it in (one unit in flight)
  zero3   +128  in backward: block k's gathered weight and the gradient it has just made
                (the reductions before it finished first; the next block gathered once its
                gradient is out); in forward likewise two: the block computing, the next
  FSDP2   +192  three units in backward (the block computing, the one prefetched, the
                gradient)
"""

from __future__ import annotations

import argparse
import ast
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak_rss import _reset_peak, _status

import phalanx as px
from phalanx.testing import run_ranks

MB = 2**20
D, BLOCKS, BATCH = 4096, 8, 8
CONFIGS = ("ddp", "zero1", "zero2", "zero3", "torch DDP", "FSDP2")
FORMULA = {"ddp": lambda n: 16, "zero1": lambda n: 8 + 8 / n, "zero2": lambda n: 4 + 12 / n,
           "zero3": lambda n: 16 / n, "torch DDP": lambda n: 16, "FSDP2": lambda n: 16 / n}
OPTIONS: dict = {}  # --option k=v: passed to px.prepare (set before the ranks are forked)


def make_model(d: int = D, blocks: int = BLOCKS) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(d, d) for _ in range(blocks)])


def build(config: str, d: int = D, blocks: int = BLOCKS):
    model = make_model(d, blocks)
    if config == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if config == "torch DDP":
        return nn.parallel.DistributedDataParallel(model), optimizer
    return px.prepare(model, optimizer, strategy=config, **OPTIONS)


def train_step(model, optimizer, x, y, run=lambda name, fn: fn()):
    loss = run("forward", lambda: F.mse_loss(model(x), y))
    run("backward", loss.backward)
    del loss
    run("step", optimizer.step)
    run("zero_grad", optimizer.zero_grad)


def measure_rank(config: str, steps: int, phases: bool, account: bool):
    torch.manual_seed(100 + px.rank())
    tiny, tiny_opt = build(config, d=64, blocks=2)
    for _ in range(2):
        train_step(tiny, tiny_opt, torch.randn(BATCH, 64), torch.randn(BATCH, 64))
    del tiny, tiny_opt
    data = [(torch.randn(BATCH, D), torch.randn(BATCH, D)) for _ in range(steps)]
    gc.collect()
    baseline = _status("VmRSS")
    _reset_peak()
    model, optimizer = build(config)
    n_params = BLOCKS * (D * D + D)
    peaks = {k: 0 for k in ("forward", "backward", "step", "zero_grad")}
    top = [0]

    def run(name, fn):
        if phases:
            top[0] = max(top[0], _status("VmHWM"))
            _reset_peak()
        result = fn()
        if phases:
            peaks[name] = max(peaks[name], _status("VmHWM") - baseline)
        return result

    accountant = None
    if account:
        from anchors_account import Accountant
        accountant = Accountant(model, optimizer, config, baseline)
    times = []
    for x, y in data:
        start = time.perf_counter()
        train_step(model, optimizer, x, y, run)
        times.append(time.perf_counter() - start)
    peak = max(_status("VmHWM"), top[0]) - baseline
    return {"rise": peak, "params": n_params, "peaks": peaks, "steady": _status("VmRSS") - baseline,
            "step_s": statistics.median(times[1:] or times),
            "account": accountant.report() if accountant is not None else None}


def measure(configs, ranks: int, steps: int, phases: bool, account: bool) -> list[dict]:
    rows = []
    for config in configs:
        results = run_ranks(measure_rank, ranks, args=(config, steps, phases, account),
                            timeout=1800)
        top = max(results, key=lambda r: r["rise"])
        formula = FORMULA[config](ranks) * top["params"]
        rows.append(dict(top, config=config, formula=formula, rises=[r["rise"] for r in results],
                         accounts=[r["account"] for r in results],
                         step_s=max(r["step_s"] for r in results)))
        print(f"  {config}: rise {top['rise'] / MB:.1f} MiB, {top['rise'] / formula:.3f}x the "
              f"formula", flush=True)
    return rows


def print_table(rows, phases: bool) -> None:
    print("\n| config | formula MiB | rise MiB (per rank) | rise / formula | above the formula MiB "
          "| held after the steps MiB | step s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ranks = " / ".join(f"{x / MB:.1f}" for x in r["rises"])
        print(f"| {r['config']} | {r['formula'] / MB:.1f} | {r['rise'] / MB:.1f} ({ranks}) | "
              f"{r['rise'] / r['formula']:.3f} | {(r['rise'] - r['formula']) / MB:+.1f} | "
              f"{r['steady'] / MB:.1f} | {r['step_s']:.3f} |")
    if phases:
        print("\npeak rise within each phase, MiB above the baseline (the larger rank's):")
        print("| config | forward | backward | step | zero_grad |")
        print("|---|---|---|---|---|")
        for r in rows:
            p = r["peaks"]
            print(f"| {r['config']} | {p['forward'] / MB:.1f} | {p['backward'] / MB:.1f} | "
                  f"{p['step'] / MB:.1f} | {p['zero_grad'] / MB:.1f} |")
    for r in rows:
        for rank, acc in enumerate(r["accounts"]):
            if acc:
                print(f"\n{r['config']}, rank {rank}: {acc}")
    sys.stdout.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--account", action="store_true")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a px.prepare option for the phalanx configurations, e.g. prefetch=0")
    args = parser.parse_args(argv)
    for kv in args.option:
        key, value = kv.split("=", 1)
        OPTIONS[key] = ast.literal_eval(value)
    malloc = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_"))
    print(f"{args.ranks} ranks, CPU, gloo, 1 thread each, torch {torch.__version__}; "
          f"{BLOCKS} x Linear({D}, {D}); fp32 AdamW; batch {BATCH} x {D}; {args.steps} steps; "
          f"prewarmed by a tiny model; glibc malloc: {malloc or 'as it comes'}; "
          f"options {OPTIONS or 'none'}", flush=True)
    print_table(measure(args.configs.split(","), args.ranks, args.steps, args.phases,
                        args.account), args.phases)


if __name__ == "__main__":
    main()
