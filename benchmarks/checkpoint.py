"""Checkpoint save and load time, the time training is blocked, and bytes written.

    .venv/bin/python benchmarks/checkpoint.py                 # 100M parameters, 2 ranks, CPU
    .venv/bin/python benchmarks/checkpoint.py --blocks 2      # a small model, a quick look

The model is an MLP of `--blocks` blocks of Linear 1024 -> 4096 -> 1024 (12 blocks: 100.8M
parameters), fp32, AdamW after one step (so the state is 16 bytes per parameter: weights 4,
Adam's two moments 8, plus the step counts). On 2 ranks (gloo, one thread each), every
competitor saves the same state into a fresh directory under `--dir` and loads it back into a
fresh model, `--repeat` times, interleaved; times are the slowest rank's, medians:

  phalanx ddp / zero2     px.save (each rank writes its shards or its share), px.load
  phalanx ... background  px.save(background=True): "blocked" is until the call returns (the
                          state is copied), "save" until the checkpoint is complete
  torch.save, rank 0      the plain model's state_dict() and the optimizer's, saved by rank 0
                          with torch.save (the other ranks wait); loaded by torch.load on
                          every rank
  DCP                     torch.distributed.checkpoint.save / load of the plain model's and
                          optimizer's state dicts (replicated tensors deduplicated by DCP)

The page cache is not dropped between runs (that needs root): loads read from memory, as they
would right after a save. Bytes are what the directory holds after the save.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import phalanx as px
from phalanx.testing import run_ranks

D, HIDDEN = 1024, 4096


def make_model(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))
                           for _ in range(blocks)])


def one_step(model, opt) -> None:
    model(torch.randn(4, D)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def model_and_optimizer(blocks: int, stepped: bool):
    """The plain model and its AdamW, after one step (so the optimizer has its state) or not."""
    model = make_model(blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if stepped:
        one_step(model, opt)
    return model, opt


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def phalanx_case(strategy: str, background: bool, blocks: int, where: str) -> dict:
    model, opt = px.prepare(*model_and_optimizer(blocks, stepped=False), strategy=strategy)
    one_step(model, opt)
    path = os.path.join(where, "ckpt")
    out = {}
    if background:
        out["blocked"] = timed(lambda: px.save(path, model=model, optimizer=opt,
                                               background=True, step=1))
        out["save"] = out["blocked"] + timed(px.checkpoint.wait_for_saves)
    else:
        out["save"] = timed(lambda: px.save(path, model=model, optimizer=opt, step=1))
    out["bytes"] = du(path)
    fresh, fresh_opt = px.prepare(*model_and_optimizer(blocks, stepped=False),
                                  strategy=strategy)
    out["load"] = timed(lambda: px.load(path, model=fresh, optimizer=fresh_opt))
    return out


def torch_save_case(blocks: int, where: str) -> dict:
    model, opt = model_and_optimizer(blocks, stepped=True)
    path = os.path.join(where, "state.pt")

    def save():
        if dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)

    out = {"save": timed(save), "bytes": du(path)}
    fresh, fresh_opt = model_and_optimizer(blocks, stepped=False)

    def load():
        state = torch.load(path, weights_only=True)
        fresh.load_state_dict(state["model"])
        fresh_opt.load_state_dict(state["optimizer"])

    out["load"] = timed(load)
    return out


def dcp_case(blocks: int, where: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model, opt = model_and_optimizer(blocks, stepped=True)
    path = os.path.join(where, "dcp")
    out = {"save": timed(lambda: dcp.save({"model": model.state_dict(),
                                           "optimizer": opt.state_dict()}, checkpoint_id=path))}
    out["bytes"] = du(path)
    # DCP loads into existing tensors: the optimizer state must exist
    fresh, fresh_opt = model_and_optimizer(blocks, stepped=True)

    def load():
        state = {"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state["model"])
        fresh_opt.load_state_dict(state["optimizer"])

    out["load"] = timed(load)
    return out


CASES = {
    "phalanx ddp": lambda b, w: phalanx_case("ddp", False, b, w),
    "phalanx ddp background": lambda b, w: phalanx_case("ddp", True, b, w),
    "phalanx zero2": lambda b, w: phalanx_case("zero2", False, b, w),
    "phalanx zero2 background": lambda b, w: phalanx_case("zero2", True, b, w),
    "torch.save, rank 0": torch_save_case,
    "DCP": dcp_case,
}


def _trim() -> None:
    """Give freed heap memory back to the system (glibc), so cases do not add up."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def bench_rank(blocks: int, repeat: int, base: str) -> dict:
    torch.set_num_threads(1)
    results = {name: [] for name in CASES}
    for r in range(repeat):
        names = list(CASES)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            where = os.path.join(base, f"{r}-{name.replace(' ', '_').replace(',', '')}")
            if dist.get_rank() == 0:
                os.makedirs(where, exist_ok=True)
            dist.barrier()
            results[name].append(CASES[name](blocks, where))
            gc.collect()  # the case's models and engines (reference cycles) go now, not later
            _trim()
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(where, ignore_errors=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = parser.parse_args(argv)
    base = tempfile.mkdtemp(prefix="phalanx-ckpt-bench-", dir=args.dir)
    params = sum(p.numel() for p in make_model(args.blocks).parameters())
    gc.collect()
    try:
        results = run_ranks(bench_rank, 2, args=(args.blocks, args.repeat, base),
                            timeout=3600)[0]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"2 ranks, CPU, gloo; {params / 1e6:.1f}M fp32 parameters, AdamW; medians of "
          f"{args.repeat}; seconds (slowest rank)")
    print(f"{'competitor':26s} {'save s':>8s} {'blocked s':>10s} {'load s':>8s} "
          f"{'MB written':>11s}")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        blocked = f"{med['blocked']:.2f}" if "blocked" in med else "-"
        print(f"{name:26s} {med['save']:8.2f} {blocked:>10s} {med['load']:8.2f} "
              f"{med['bytes'] / 2**20:11.1f}")


if __name__ == "__main__":
    main()
