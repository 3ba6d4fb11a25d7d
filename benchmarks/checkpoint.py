"""Checkpoint save and load time, the time training is blocked, memory, and bytes written,
beside DCP; and the load of one checkpoint at 2, 4 and 8 ranks.

    .venv/bin/python benchmarks/checkpoint.py                 # 50M parameters, 2 ranks, CPU
    .venv/bin/python benchmarks/checkpoint.py --blocks 2      # a small model, a quick look
    .venv/bin/python benchmarks/checkpoint.py --worlds 2 4 8  # then the resume at other sizes

The model is an MLP of `--blocks` blocks of Linear 1024 -> 4096 -> 1024 (6 blocks: 50.4M
parameters), fp32, AdamW after one step (so the state is 12 bytes per parameter: weights 4,
Adam's two moments 8, plus the step counts). On 2 ranks (gloo, one thread each), every
competitor saves the same state into a fresh directory under `--dir` and loads it back into a
fresh model and a fresh optimizer (one that has never stepped, as a resumed job has),
`--repeat` times, interleaved; times are the slowest rank's, medians:

  phalanx ddp / zero2 / zero3   px.save (each rank writes what it owns), px.load
  phalanx ... background        px.save(background=True): "blocked" is until the call returns
                                (the state is copied), "save" until the checkpoint is complete
  torch.save, rank 0            the plain model's state_dict() and the optimizer's, saved by
                                rank 0 with torch.save (the other ranks wait); loaded by
                                torch.load on every rank
  DCP                           the plain (replicated) model: dcp.save / dcp.load through DCP's
                                own state-dict API (get_state_dict, which makes a fresh
                                optimizer's state by a step at lr 0, then set_state_dict)
  DCP async                     dcp.async_save: "blocked" until it returns (its default stager
                                copies the state in the call), "save" until its future is done
  DCP async, staged apart       dcp.async_save with DefaultStager(use_async_staging=True): it
                                returns at once and copies on a thread; "blocked" is until the
                                copy is done (training must not change the state before)
  FSDP2 + DCP                   fully_shard on each block and the model, the same API: the
                                sharded competitor of zero2 and zero3

"again s" is the blocked time of a second background save in the same processes, after another
step, as a run saves every so many steps. "extra MB" is the rise of the process's peak resident
memory (VmHWM, reset before the save) over its resident memory before it, to the end of the
save, the largest rank's. The page cache is not dropped between runs (that needs root): loads
read from memory, as they would right after a save. Bytes are what the directory holds after
the save.

`--worlds`: one zero3 checkpoint of phalanx and one FSDP2 DCP checkpoint, saved at 2 ranks, are
loaded at each world size in turn (the phalanx one under zero3, and into zero2 and ddp) (fresh
processes, `--repeat` loads each); per rank, the wall time and the CPU time (user + system, all
threads) of the load, the slowest rank's, medians. On a machine with fewer cores than ranks the
wall time grows with the processes sharing the cores; the CPU time is each rank's own work.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import phalanx as px
from phalanx.testing import run_ranks
from phalanx.world.process import state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak_rss import _reset_peak, _status

D, HIDDEN = 1024, 4096


def make_model(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))
                           for _ in range(blocks)])


def one_step(model, opt) -> None:
    model(torch.randn(4, D)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def model_and_optimizer(blocks: int, stepped: bool, fsdp: bool = False):
    """The plain model (or FSDP2's, sharded over the world) and its AdamW, after one step (so
    the optimizer has its state) or not."""
    model = make_model(blocks)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if stepped:
        one_step(model, opt)
    return model, opt


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


def _cpu() -> float:
    """This process's CPU seconds, user and system, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn, what: dict | None = None, key: str = "") -> float:
    """The slowest rank's wall seconds for `fn()`; with `what`, also its CPU seconds (`key`
    + " cpu") and its rise of peak memory in bytes (`key` + " extra")."""
    dist.barrier()
    _reset_peak()
    before, cpu = _status("VmRSS"), _cpu()
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    cpu, extra = _cpu() - cpu, _status("VmHWM") - before
    dist.barrier()
    figures = torch.tensor([took, cpu, float(extra)], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if what is not None:
        what[key + " cpu"], what[key + " extra"] = figures[1].item(), figures[2].item()
    return figures[0].item()


def phalanx_case(strategy: str, background: bool, blocks: int, where: str) -> dict:
    model, opt = px.prepare(*model_and_optimizer(blocks, stepped=False), strategy=strategy)
    one_step(model, opt)
    path = os.path.join(where, "ckpt")
    out = {}
    if background:
        def save():
            out["blocked"] = timed(lambda: px.save(path, model=model, optimizer=opt,
                                                   background=True, step=1))
            px.checkpoint.wait_for_saves()
    else:
        def save():
            px.save(path, model=model, optimizer=opt, step=1)
    out["save"] = timed(save, out, "save")
    out["bytes"] = du(path)
    if background:  # a second save, as a run saves every so many steps
        one_step(model, opt)
        again = os.path.join(where, "again")
        out["again"] = timed(lambda: px.save(again, model=model, optimizer=opt,
                                             background=True, step=2))
        px.checkpoint.wait_for_saves()
    model = opt = None  # the saved state goes before the fresh one is made
    fresh, fresh_opt = px.prepare(*model_and_optimizer(blocks, stepped=False),
                                  strategy=strategy)
    out["load"] = timed(lambda: px.load(path, model=fresh, optimizer=fresh_opt), out, "load")
    return out


def torch_save_case(blocks: int, where: str) -> dict:
    model, opt = model_and_optimizer(blocks, stepped=True)
    path = os.path.join(where, "state.pt")

    def save():
        if dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)

    out = {}
    out["save"] = timed(save, out, "save")
    out["bytes"] = du(path)
    model = opt = None  # the saved state goes before the fresh one is made
    fresh, fresh_opt = model_and_optimizer(blocks, stepped=False)

    def load():
        state = torch.load(path, weights_only=True)
        fresh.load_state_dict(state["model"])
        fresh_opt.load_state_dict(state["optimizer"])

    out["load"] = timed(load, out, "load")
    return out


def dcp_save(model, opt, path: str, how: str, out: dict) -> None:
    """Save through DCP: `how` is "sync", "async" (async_save, its default stager) or
    "staged" (async_save with staging on a thread)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def state():
        model_state, optim_state = get_state_dict(model, opt)
        return {"model": model_state, "optimizer": optim_state}

    if how == "sync":
        out["save"] = timed(lambda: dcp.save(state(), checkpoint_id=path), out, "save")
        return
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    pending = {"stager": None}
    group = _async_group()
    if how == "staged":
        pending["stager"] = DefaultStager(StagingOptions(use_pinned_memory=False,
                                                         use_shared_memory=False,
                                                         use_async_staging=True,
                                                         use_non_blocking_copy=False))

    def start():
        if how == "async":
            pending["done"] = dcp.async_save(state(), checkpoint_id=pending["path"],
                                             process_group=group)
        else:
            response = dcp.async_save(state(), checkpoint_id=pending["path"],
                                      async_stager=pending["stager"], process_group=group)
            response.staging_completion.result()  # the state may change only after this
            pending["done"] = response.upload_completion

    def save(key):
        out[key] = timed(start)
        pending["done"].result()

    pending["path"] = path
    out["save"] = timed(lambda: save("blocked"), out, "save")
    one_step(model, opt)  # a second save, as a run saves every so many steps
    pending["path"] = path + "-again"
    save("again")
    if pending["stager"] is not None:
        pending["stager"].close()


_GROUP = []


def _async_group():
    """A gloo group of its own for DCP's async saves, as DCP's documentation asks: the save's
    thread makes collectives while the main thread goes on making its own."""
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def dcp_load(blocks: int, path: str, fsdp: bool, out: dict, key: str = "load") -> None:
    """Load through DCP's state-dict API into a fresh model and optimizer, as a resumed job
    does: get_state_dict (which makes the optimizer's state), dcp.load, set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    fresh, fresh_opt = model_and_optimizer(blocks, stepped=False, fsdp=fsdp)

    def load():
        model_state, optim_state = get_state_dict(fresh, fresh_opt)
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
        set_state_dict(fresh, fresh_opt, model_state_dict=model_state,
                       optim_state_dict=optim_state)

    out[key] = timed(load, out, key)


def dcp_case(how: str, fsdp: bool, blocks: int, where: str) -> dict:
    model, opt = model_and_optimizer(blocks, stepped=True, fsdp=fsdp)
    path = os.path.join(where, "dcp")
    out = {}
    dcp_save(model, opt, path, how, out)
    out["bytes"] = du(path)
    model = opt = None  # the saved state goes before the fresh one is made
    dcp_load(blocks, path, fsdp, out)
    return out


CASES = {
    "phalanx ddp": lambda b, w: phalanx_case("ddp", False, b, w),
    "phalanx ddp background": lambda b, w: phalanx_case("ddp", True, b, w),
    "phalanx zero2": lambda b, w: phalanx_case("zero2", False, b, w),
    "phalanx zero2 background": lambda b, w: phalanx_case("zero2", True, b, w),
    "phalanx zero3": lambda b, w: phalanx_case("zero3", False, b, w),
    "phalanx zero3 background": lambda b, w: phalanx_case("zero3", True, b, w),
    "torch.save, rank 0": torch_save_case,
    "DCP": lambda b, w: dcp_case("sync", False, b, w),
    "DCP async": lambda b, w: dcp_case("async", False, b, w),
    "DCP async, staged apart": lambda b, w: dcp_case("staged", False, b, w),
    "FSDP2 + DCP": lambda b, w: dcp_case("sync", True, b, w),
    "FSDP2 + DCP async": lambda b, w: dcp_case("async", True, b, w),
}


def _trim() -> None:
    """Give freed heap memory back to the system (glibc), so cases do not add up."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def bench_rank(blocks: int, repeat: int, base: str, only: list[str]) -> dict:
    torch.set_num_threads(1)
    results = {name: [] for name in only}
    for r in range(repeat):
        names = list(only)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            where = os.path.join(base, f"{r}-{name.replace(' ', '_').replace(',', '')}")
            if dist.get_rank() == 0:
                os.makedirs(where, exist_ok=True)
            dist.barrier()
            results[name].append(CASES[name](blocks, where))
            getattr(state, "staged", {}).clear()  # a background save's kept copy is the case's own
            gc.collect()  # the case's models and engines (reference cycles) go now, not later
            _trim()
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(where, ignore_errors=True)
    return results


# -- one checkpoint loaded at other world sizes --------------------------------------------------
def save_both(blocks: int, base: str) -> None:
    """At 2 ranks: a phalanx zero3 checkpoint and an FSDP2 DCP one, of the same state."""
    torch.set_num_threads(1)
    model, opt = px.prepare(*model_and_optimizer(blocks, stepped=False), strategy="zero3")
    one_step(model, opt)
    px.save(os.path.join(base, "phalanx"), model=model, optimizer=opt, step=1)
    del model, opt
    gc.collect()
    model, opt = model_and_optimizer(blocks, stepped=True, fsdp=True)
    dcp_save(model, opt, os.path.join(base, "dcp"), "sync", {})


def phalanx_load(blocks: int, path: str, out: dict, strategy: str = "zero3") -> None:
    fresh, fresh_opt = px.prepare(*model_and_optimizer(blocks, stepped=False), strategy=strategy)
    out["load"] = timed(lambda: px.load(path, model=fresh, optimizer=fresh_opt), out, "load")


def load_at(blocks: int, base: str, repeat: int) -> dict:
    torch.set_num_threads(1)
    out = {"phalanx zero3": [], "FSDP2 + DCP": [], "phalanx zero3 into zero2": [],
           "phalanx zero3 into ddp": []}
    for r in range(repeat):
        for name in (out if r % 2 == 0 else reversed(list(out))):
            got = {}
            if name == "FSDP2 + DCP":
                dcp_load(blocks, os.path.join(base, "dcp"), True, got)
            else:
                phalanx_load(blocks, os.path.join(base, "phalanx"), got,
                             name.split()[-1] if "into" in name else "zero3")
            out[name].append(got)
            gc.collect()
            _trim()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    parser.add_argument("--only", nargs="*", default=list(CASES), help="competitors to run")
    parser.add_argument("--worlds", type=int, nargs="*", default=[],
                        help="then load a 2-rank checkpoint at each of these world sizes")
    args = parser.parse_args(argv)
    base = tempfile.mkdtemp(prefix="phalanx-ckpt-bench-", dir=args.dir)
    params = sum(p.numel() for p in make_model(args.blocks).parameters())
    gc.collect()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; gloo, one "
          f"thread a rank; {params / 1e6:.1f}M fp32 parameters, AdamW; medians of "
          f"{args.repeat}; the slowest rank")
    try:
        if args.only:
            results = run_ranks(bench_rank, 2, args=(args.blocks, args.repeat, base, args.only),
                                timeout=3600)[0]
            _table(results)
        if args.worlds:
            run_ranks(save_both, 2, args=(args.blocks, base), timeout=1200)
            rows = {}
            for world in args.worlds:
                for name, runs in run_ranks(load_at, world, args=(args.blocks, base, args.repeat),
                                            timeout=3600)[0].items():
                    rows[(name, world)] = runs
            _worlds_table(rows)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def _table(results: dict) -> None:
    dcp = {"load": _median(results.get("DCP", []), "load"),
           "blocked": _median(results.get("DCP async", []), "blocked")}
    print(f"{'competitor':26s} {'save s':>7s} {'blocked s':>10s} {'again s':>8s} "
          f"{'extra MB':>9s} "
          f"{'load s':>7s} {'load/DCP':>9s} {'load cpu s':>11s} {'MB written':>11s}")
    for name, runs in results.items():
        def cell(key, scale=1.0, width=7, fmt=".2f", runs=runs):
            value = _median(runs, key)
            return f"{value / scale:{width}{fmt}}" if value is not None else f"{'-':>{width}s}"
        load = _median(runs, "load")
        ratio = f"{load / dcp['load']:9.2f}" if dcp["load"] else f"{'-':>9s}"
        print(f"{name:26s} {cell('save')} {cell('blocked', width=10)} {cell('again', width=8)} "
              f"{cell('save extra', 2**20, 9, '.0f')} {cell('load')} {ratio} "
              f"{cell('load cpu', width=11)} {cell('bytes', 2**20, 11, '.1f')}")


def _worlds_table(rows: dict) -> None:
    print("one 2-rank checkpoint loaded at each world size (fresh processes): seconds a rank")
    print(f"{'competitor':24s} {'ranks':>5s} {'load s':>7s} {'load cpu s':>11s}")
    for (name, world), runs in sorted(rows.items()):
        print(f"{name:24s} {world:5d} {_median(runs, 'load'):7.2f} "
              f"{_median(runs, 'load cpu'):11.2f}")


if __name__ == "__main__":
    main()
