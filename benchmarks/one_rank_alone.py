"""What it costs that one rank may act alone (engine/remote.py): the idle shard service, and the
full state taken by rank 0 alone against `px.save` of the same model.

    .venv/bin/python benchmarks/one_rank_alone.py               # every part, 2 ranks, CPU
    .venv/bin/python benchmarks/one_rank_alone.py --part idle --rounds 6
    .venv/bin/python benchmarks/one_rank_alone.py --part state --blocks 8

Idle: the 12.6M-parameter MLP of benchmarks/ddp.py (6 blocks of Linear 512 -> 2048 -> 512,
fp32, AdamW, 32 x 512 per rank) trains under zero2 and zero3 on 2 ranks (gloo, one thread
each) with the shard service as built ("service") and with none ("no service": the engine is
built without it, as in a world of one). Each run is a fresh pair of processes; the two kinds
alternate, `--rounds` of each; a run's figure is the median over `--steps` steps of the slowest
rank's step time; the table gives the median over runs and the ratio.

Eval: the same MLP under zero3, every rank running forwards under `torch.no_grad()` at once,
reading the units one-sidedly from the peers (as built) against gathering them collectively
(as a forward with gradients does), alternating, `--rounds` of `--steps` forwards each.

State: an MLP of `--blocks` blocks of Linear 4096 -> 4096 (8 blocks: 134.3M parameters), fp32,
AdamW after one step, zero3 on 2 ranks. Rank 0 alone takes `model.state_dict()` and
`optimizer.state_dict()` (the full single-process state, onto its CPU) while rank 1 waits at a
barrier; against `px.save` of the same model and optimizer by every rank (each writes its
shards) into a fresh directory. Times are medians over `--repeat`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))

import phalanx as px
from phalanx.launch.spawn import run_workers


def run_ranks(fn, world, args=(), timeout=600):
    """The test harness's forked ranks, over a TCP store as under `phalanx run` (the harness's
    file store polls every 10 ms, which would be most of a shard read's time)."""
    return run_workers(fn, world, args, None, timeout=timeout, threads=1, rendezvous="tcp",
                       start_method="fork")
from ddp import batch_for, loss_for, make  # noqa: E402


def _idle_run(strategy: str, service: bool, steps: int) -> float:
    if not service:  # the engine as in a world of one: no thread, no service group
        import phalanx.engine.flat_engine as flat_engine
        flat_engine.service_for = lambda comm: None
    model = make("mlp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = px.prepare(model, optimizer, strategy=strategy)
    times = []
    for i in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        x, y = batch_for("mlp", px.rank(), i)
        loss_for("mlp", model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= 2:  # two warm-up steps
            times.append(elapsed.item())
    return statistics.median(times)


def idle(rounds: int, steps: int) -> None:
    print("Idle shard service, 2 ranks, 12.6M MLP, fp32 AdamW: step time (s), medians over runs")
    print(f"{'strategy':10} {'service':>9} {'no service':>11} {'ratio':>7}   runs (s)")
    for strategy in ("zero2", "zero3"):
        got = {True: [], False: []}
        for _ in range(rounds):
            for service in (True, False):
                got[service].append(run_ranks(_idle_run, 2, args=(strategy, service, steps),
                                              timeout=600)[0])
        on, off = statistics.median(got[True]), statistics.median(got[False])
        runs = " ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(got[True], got[False]))
        print(f"{strategy:10} {on:9.4f} {off:11.4f} {on / off:7.3f}   {runs}", flush=True)


def _eval_run(rounds: int, steps: int) -> dict:
    from phalanx.testing import engine_of

    model = make("mlp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = px.prepare(model, optimizer, strategy="zero3")
    x, y = batch_for("mlp", px.rank(), 0)
    loss_for("mlp", model, x, y).backward()
    optimizer.step()
    optimizer.zero_grad()
    gatherer = engine_of(model).gatherer
    fetch = gatherer.fetch
    times = {"one-sided": [], "collective": []}
    for _ in range(rounds):
        for kind in times:
            gatherer.fetch = fetch if kind == "one-sided" else None
            dist.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                for _ in range(steps):
                    model(x)
            elapsed = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[kind].append(elapsed.item())
    return {kind: statistics.median(t) for kind, t in times.items()}


def evaluation(rounds: int, steps: int) -> None:
    r = run_ranks(_eval_run, 2, args=(rounds, steps), timeout=600)[0]
    print("zero3 evaluation on every rank at once (12.6M MLP, 2 ranks, forward under no_grad):")
    print(f"  one-sided reads (as built) {r['one-sided'] * 1e3:.1f} ms, collective gathers "
          f"{r['collective'] * 1e3:.1f} ms, ratio {r['one-sided'] / r['collective']:.2f}")


D = 4096


def _state_run(blocks: int, repeat: int, root: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(D, D) for _ in range(blocks)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = px.prepare(model, optimizer, strategy="zero3", blocks=nn.Linear)
    model(torch.randn(4, D)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    alone, saved = [], []
    for i in range(repeat):
        dist.barrier()
        if px.rank() == 0:
            start = time.perf_counter()
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            alone.append(time.perf_counter() - start)
            numel = sum(v.numel() for v in state["model"].values())
            del state
        dist.barrier()
        path = f"{root}/ckpt-{i}"
        start = time.perf_counter()
        px.save(path, model=model, optimizer=optimizer)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        saved.append(elapsed.item())
        if px.rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
    if px.rank() != 0:
        return {}
    return {"alone": statistics.median(alone), "save": statistics.median(saved),
            "params": numel}


def state(blocks: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        r = run_ranks(_state_run, 2, args=(blocks, repeat, root), timeout=600)[0]
    print(f"Full state of a {r['params'] / 1e6:.1f}M-parameter zero3 model (fp32 AdamW), 2 ranks,"
          f" medians of {repeat}")
    print(f"  rank 0 alone: model.state_dict() + optimizer.state_dict()  {r['alone']:.2f} s")
    print(f"  every rank:   px.save (each rank writes its shards)        {r['save']:.2f} s")
    print(f"  ratio alone / px.save: {r['alone'] / r['save']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("idle", "state", "eval", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.part in ("idle", "all"):
        idle(args.rounds, args.steps)
    if args.part in ("eval", "all"):
        evaluation(args.rounds, args.steps)
    if args.part in ("state", "all"):
        state(args.blocks, args.repeat)


if __name__ == "__main__":
    main()
