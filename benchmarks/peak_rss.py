"""Memory as a user sees it: the rise of each rank's peak resident set over training steps,
beside the ZeRO formula plus the buffers the configuration adds.

    .venv/bin/python benchmarks/peak_rss.py                    # 2 ranks, the glibc malloc as set
    .venv/bin/python benchmarks/peak_rss.py --malloc default,mmap64k,trim128m
    .venv/bin/python benchmarks/peak_rss.py --phases           # where in the step the peak is
    .venv/bin/python benchmarks/peak_rss.py --adamw fused      # AdamW(fused=True)

The model and batch are those of benchmarks/memory.py: 8 blocks of Linear 1024 -> 2048 -> 1024
(33.6M parameters), fp32, AdamW, a batch of 8 x 1024 per rank, MSE loss. Each configuration
runs in fresh processes (one `run_ranks` per configuration), 2 ranks, gloo, one thread each.

Per rank, exactly:

  baseline  VmRSS after imports, the process group and the batches are made, just before the
            model is built
  then      build the model and AdamW, `px.prepare` (or wrap in torch DDP), train `--warmup`
            steps, reset the high-water mark (`echo 5 > /proc/self/clear_refs`), train
            `--steps` steps (forward, backward, optimizer.step(), optimizer.zero_grad())
  rise      VmHWM after those steps - baseline

The table compares the rise (largest over ranks) with the formula (fp32 AdamW, Psi parameters,
N ranks: ddp 16 Psi, zero1 (8 + 8/N) Psi, zero2 (4 + 12/N) Psi; Rajbhandari et al. 2020) plus
the configured buffers: ZeRO-2's pool of two buffers of the largest unit that borrows one (up
to `bucket_mb`); for torch DDP with its
default `gradient_as_bucket_view=False`, its buckets, a second copy of every gradient (4 Psi).
Activations are not in the formula; they are measured separately (every tensor autograd saves
for backward in one step, by distinct storage, parameters excluded) and given as a column.
"rise/formula" is the ratio as first reported (formula only, no buffers).

--malloc runs everything once per glibc malloc setting, each in a fresh interpreter (the
settings are read when the process starts, and the ranks are forked from it):

  default    glibc as it comes: the mmap threshold starts at 128 KiB and rises to the size of
             any mmapped block freed (up to 32 MiB), after which blocks of that size come from
             the heap, and freed heap memory stays resident until the top of the heap is free
  mmap64k    MALLOC_MMAP_THRESHOLD_=65536: every block of 64 KiB or more is its own mmap,
             returned to the system when freed
  trim128m   MALLOC_TRIM_THRESHOLD_=134217728: any explicit setting turns off the dynamic mmap
             threshold, so it stays at 128 KiB; the trim setting itself barely matters then

--prewarm separates what does not grow with the model: `imports` builds a throwaway AdamW
before the baseline (torch imports torch._dynamo, sympy and more at the first optimizer it
builds), `tiny` runs the whole configuration on a tiny model first (also the kernels' code
pages, gloo's first collectives). The differences between the three, with --malloc mmap64k
(where the numbers repeat to 0.5 MB), are those fixed costs; what remains is the model's.

--adamw foreach / fused shows the optimizer's temporaries (on CPU, AdamW's default is its
per-tensor loop; foreach is the default on GPU). --trim and --mallopt show what phalanx could
do itself: malloc_trim(0) after every step, or mallopt(M_MMAP_THRESHOLD) when a rank starts
(the same effect as the environment variable, without one).

--phases resets the high-water mark around every phase of every measured step and prints, per
configuration, the rise of the peak within the forward, the backward, optimizer.step() and
zero_grad(), the resident set after each (and after the model is built and prepared), and the
minor page faults per step (each a first touch of a 4 KiB page: what returning memory to the
system costs in exchange).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import resource
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory import FORMULA, make_model

import phalanx as px
from phalanx.testing import run_ranks

MB = 2**20
D = 1024
CONFIGS = ("phalanx ddp", "phalanx zero1", "phalanx zero2", "torch DDP",
           "torch DDP bucket-view")
MALLOC = {
    "default": {},
    "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    "trim128m": {"MALLOC_TRIM_THRESHOLD_": str(128 * MB)},
}
M_MMAP_THRESHOLD = -3  # mallopt(3)
_MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark becomes the current resident set


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


ADAMW = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


BLOCKS = [8]  # --blocks: the model's size (set before the ranks are forked)


def _build(config: str, adamw: str, bucket_mb: float, tiny: bool = False):
    model = make_model(blocks=2, d=64, hidden=128) if tiny else make_model(blocks=BLOCKS[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **ADAMW[adamw])
    if config.startswith("phalanx"):
        model, optimizer = px.prepare(model, optimizer, strategy=config.split()[1],
                                      bucket_mb=bucket_mb)
    else:
        model = nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=config.endswith("bucket-view"))
    return model, optimizer


def _saved_bytes(model, x, y) -> int:
    """Bytes of the distinct storages autograd saves for backward in one step, parameters
    (and views of them) excluded: the activations."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.mse_loss(model(x), y)  # the graph is dropped unused
    return sum(storages.values())


def _prewarm(how: str, config: str, adamw: str, bucket_mb: float, batch: int) -> None:
    """What to do before the baseline is taken (see --prewarm)."""
    if how == "imports":  # torch imports torch._dynamo (and sympy, ...) at its first optimizer
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))], **ADAMW[adamw])
    elif how == "tiny":  # the whole configuration once, on a model too small to matter
        model, optimizer = _build(config, adamw, bucket_mb, tiny=True)
        for _ in range(2):
            F.mse_loss(model(torch.randn(batch, 64)), torch.zeros(batch, 64)).backward()
            optimizer.step()
            optimizer.zero_grad()
        del model, optimizer


def _measure_rank(config, steps, warmup, batch, adamw, bucket_mb, phases, prewarm, trim,
                  mallopt):
    torch.manual_seed(px.rank())
    libc = ctypes.CDLL(None)
    if mallopt:  # what px.init() could do instead of an environment variable
        libc.mallopt(M_MMAP_THRESHOLD, mallopt)
    _prewarm(prewarm, config, adamw, bucket_mb, batch)
    data = [(torch.randn(batch, D), torch.randn(batch, D)) for _ in range(warmup + steps)]
    gc.collect()
    baseline = _status("VmRSS")
    baseline_file = _status("RssFile")
    model, optimizer = _build(config, adamw, bucket_mb)
    n_params = sum(p.numel() for p in model.parameters())
    built = _status("VmRSS") - baseline
    activations = _saved_bytes(model, *data[0])
    inside = []  # the resident set at each optimizer step hook (once per unit under zero1/2)
    sample = lambda *_: inside.append(_status("VmRSS") - baseline)  # noqa: E731
    optimizer.register_step_pre_hook(sample)
    optimizer.register_step_post_hook(sample)
    peaks = {k: 0 for k in ("forward", "backward", "step", "zero_grad")}
    after = dict(peaks)

    def run(name, fn):
        if phases:
            _reset_peak()
        result = fn()
        if phases:
            peaks[name] = max(peaks[name], _status("VmHWM") - baseline)
            after[name] = _status("VmRSS") - baseline
        return result

    def step(x, y):
        loss = run("forward", lambda: F.mse_loss(model(x), y))
        run("backward", loss.backward)
        del loss
        run("step", optimizer.step)
        run("zero_grad", optimizer.zero_grad)
        if trim:  # what the engine could do at zero_grad: free heap pages back to the system
            libc.malloc_trim(0)

    for x, y in data[:warmup]:
        step(x, y)
    gc.collect()
    inside.clear()
    for k in peaks:
        peaks[k] = 0
    faults = _minflt()
    _reset_peak()
    for x, y in data[warmup:]:
        step(x, y)
    peak = _status("VmHWM") - baseline
    if phases:
        peak = max(peak, *peaks.values())
    return {"rise": peak, "built": built, "activations": activations, "peaks": peaks,
            "after": after, "inside": (min(inside), max(inside)) if inside else (0, 0),
            "faults": (_minflt() - faults) / steps, "steady": _status("VmRSS") - baseline,
            "file": _status("RssFile") - baseline_file,
            "params": n_params, "buffers": _buffers(model, config, n_params)}


def _buffers(model, config: str, n_params: int) -> int:
    """The configured buffers beyond the formula (see the module's docstring)."""
    if config.startswith("phalanx"):
        pool = model._engine.pool  # zero2: `keep` buffers, each the largest that borrows
        return 0 if pool is None else \
            pool.keep * pool.numel * torch.empty((), dtype=pool.dtype).element_size()
    return 4 * n_params if config == "torch DDP" else 0  # its buckets: a copy of every gradient


def measure_all(args) -> list[dict]:
    rows = []
    for config in args.configs.split(","):
        results = run_ranks(_measure_rank, args.ranks,
                            args=(config, args.steps, args.warmup, args.batch, args.adamw,
                                  args.bucket_mb, args.phases, args.prewarm, args.trim,
                                  args.mallopt),
                            timeout=1200)
        top = max(results, key=lambda r: r["rise"])
        n = top["params"]
        strategy = config.split()[1] if config.startswith("phalanx") else "ddp"
        rows.append(dict(top, config=config,
                         formula=FORMULA[("fp32", strategy)](args.ranks) * n,
                         rises=[r["rise"] for r in results]))
    return rows


def print_table(rows, title: str, phases: bool) -> None:
    print(f"\n{title}")
    print("| config | formula MB | buffers MB | activations MB | rise MB (per rank) | "
          "rise/formula | rise/(formula+buffers) | rise/(formula+buffers+activations) | "
          "excess MB | held after the steps MB | of the rise, file pages MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fb = r["formula"] + r["buffers"]
        ranks = " / ".join(f"{x / MB:.1f}" for x in r["rises"])
        print(f"| {r['config']} | {r['formula'] / MB:.1f} | {r['buffers'] / MB:.1f} | "
              f"{r['activations'] / MB:.2f} | {r['rise'] / MB:.1f} ({ranks}) | "
              f"{r['rise'] / r['formula']:.3f} | {r['rise'] / fb:.3f} | "
              f"{r['rise'] / (fb + r['activations']):.3f} | {(r['rise'] - fb) / MB:+.1f} | "
              f"{r['steady'] / MB:.1f} | {r['file'] / MB:.1f} |")
    if phases:
        print("\npeak rise within each phase, and the resident set after it (MB above baseline):")
        print("| config | built | fwd peak | bwd peak | after bwd | step peak | in step (hooks) "
              "| after step | zero_grad peak | after zero_grad | minor faults/step |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            p, a = r["peaks"], r["after"]
            print(f"| {r['config']} | {r['built'] / MB:.1f} | {p['forward'] / MB:.1f} | "
                  f"{p['backward'] / MB:.1f} | {a['backward'] / MB:.1f} | {p['step'] / MB:.1f} | "
                  f"{r['inside'][0] / MB:.1f}-{r['inside'][1] / MB:.1f} | {a['step'] / MB:.1f} | "
                  f"{p['zero_grad'] / MB:.1f} | {a['zero_grad'] / MB:.1f} | {r['faults']:.0f} |")
    sys.stdout.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=4, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the peak is reset")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=8,
                        help="blocks of Linear 1024 -> 2048 -> 1024 (8: 33.6M parameters)")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--adamw", choices=tuple(ADAMW), default="default",
                        help="AdamW as built (on CPU its default is the per-tensor loop), "
                             "foreach=True or fused=True")
    parser.add_argument("--phases", action="store_true", help="peaks per phase of the step")
    parser.add_argument("--prewarm", choices=("none", "imports", "tiny"), default="none",
                        help="before the baseline: nothing (the measure as defined), torch's "
                             "lazy imports at its first optimizer, or a whole tiny run of the "
                             "configuration (imports, kernels' code, gloo's first use)")
    parser.add_argument("--trim", action="store_true",
                        help="call glibc's malloc_trim(0) after every zero_grad()")
    parser.add_argument("--mallopt", type=int, default=0, metavar="BYTES",
                        help="each rank calls mallopt(M_MMAP_THRESHOLD, BYTES) when it starts")
    parser.add_argument("--malloc", default=None,
                        help=f"comma-separated glibc settings to compare: {', '.join(MALLOC)}")
    args = parser.parse_args(argv)
    BLOCKS[0] = args.blocks
    if args.malloc is None:
        setting = " ".join(f"{k}={os.environ[k]}" for k in _MALLOC_VARS if k in os.environ)
        setting = setting or "default"
        if args.trim:
            setting += ", malloc_trim(0) every step"
        if args.mallopt:
            setting += f", mallopt(M_MMAP_THRESHOLD, {args.mallopt}) in each rank"
        print(f"{args.ranks} ranks, CPU, gloo; {args.blocks} blocks; fp32 AdamW "
              f"({args.adamw}), batch {args.batch} x {D}; {args.warmup} warm-up + "
              f"{args.steps} measured steps; glibc malloc: {setting}; before the baseline: "
              f"{args.prewarm}")
        print_table(measure_all(args), "rise of the peak resident set per rank over training, "
                                       "from before the model was built (MB = MiB)",
                    args.phases)
        return
    for name in args.malloc.split(","):
        env = {k: v for k, v in os.environ.items() if k not in _MALLOC_VARS}
        env.update(MALLOC[name])
        print(f"\n===== malloc: {name} =====", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), *_drop_malloc(argv)],
                       env=env, check=True)


def _drop_malloc(argv) -> list[str]:
    argv = list(argv if argv is not None else sys.argv[1:])
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--malloc":
            skip = True
        elif not a.startswith("--malloc="):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
