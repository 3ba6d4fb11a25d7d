"""Peak resident memory of each rank while `px.prepare` reads pretrained weights with
`init=px.from_safetensors(path)`, against loading the whole model in one process.

    .venv/bin/python benchmarks/load_pretrained.py                 # 302 MB fp32, 2 ranks
    .venv/bin/python benchmarks/load_pretrained.py --shards 4      # an index of 4 files
    .venv/bin/python benchmarks/load_pretrained.py --layers 4      # a quick look

The model: `--layers` x Linear(`--d`, `--d`) in a ModuleList (zero3's units), 18 x 2048 by
default: 75.5M parameters, 302 MB in fp32, written once by a separate process as Hugging Face
writes a model (`model.safetensors`, or `--shards` files and `model.safetensors.index.json`).
Each configuration runs in fresh processes (`phalanx.testing.run_ranks`), one thread each, and
per rank measures exactly:

  baseline  VmRSS after imports, the process group, and a px.prepare of a tiny model (what a
            first prepare allocates once: gloo's buffers, lazy imports)
  then      reset the high-water mark (`echo 5 > /proc/self/clear_refs`), build the model on
            the meta device, px.prepare(model, SGD, strategy, init=px.from_safetensors(dir))
  rise      VmHWM - baseline; also the tensor bytes read from the files (`read_bytes`)

The configurations: zero3 and ddp on `--ranks` ranks; zero3 with the values drawn instead of
read (no `init=`: each module's reset_parameters, what the engine itself costs beside the
masters); one process (ddp on a world of one, which holds the whole model); and plain PyTorch
in one process (`Model()` then `load_state_dict(safetensors.torch.load_file(path))`, file by
file). The resident set counts the pages of a
file that safetensors maps into memory while it is open, so the read path opens each file for
one tensor at a time (model/pretrained.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch
import torch.nn as nn

import phalanx as px
from phalanx.testing import run_ranks

MB = 1e6


class Stack(nn.Module):
    def __init__(self, layers: int, d: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key + ":")).split()[1]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _write(directory: str, layers: int, d: int, shards: int) -> int:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {k: v.contiguous() for k, v in Stack(layers, d).state_dict().items()}
    if shards == 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"), {"format": "pt"})
    else:
        keys, weight_map = list(tensors), {}
        size = -(-len(keys) // shards)
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[i * size:(i + 1) * size]}
            save_file(part, os.path.join(directory, name), {"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _with_phalanx(directory: str | None, strategy: str, layers: int, d: int) -> dict:
    torch.set_num_threads(1)
    warm = nn.Linear(2, 2)
    px.prepare(warm, torch.optim.SGD(warm.parameters(), lr=0.1), strategy=strategy)
    baseline = _status("VmRSS")
    _reset_peak()
    with torch.device("meta"):
        model = Stack(layers, d)
    weights = px.from_safetensors(directory) if directory is not None else None
    model, _ = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy,
                          init=weights)
    return {"rise": _status("VmHWM") - baseline,
            "read": weights.read_bytes if weights is not None else None}


def _with_torch(directory: str, layers: int, d: int) -> dict:
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    baseline = _status("VmRSS")
    _reset_peak()
    model = Stack(layers, d)
    for name in files:  # file by file, as a model split over files is loaded
        model.load_state_dict(load_file(os.path.join(directory, name)), strict=False)
    return {"rise": _status("VmHWM") - baseline, "read": None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--shards", type=int, default=1, help="files (1: model.safetensors)")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args(argv)
    # mkdtemp, not TemporaryDirectory: its finalizer would run in the forked ranks as they exit
    directory = tempfile.mkdtemp(prefix="load-pretrained-")
    try:
        # written by a process of its own: the ranks fork from this one, which never holds it
        (model_bytes,) = run_ranks(_write, 1, args=(directory, args.layers, args.d, args.shards),
                                   timeout=600)
        rows = []
        for strategy in ("zero3", "ddp"):
            results = run_ranks(_with_phalanx, args.ranks, timeout=600,
                                args=(directory, strategy, args.layers, args.d))
            rows += [(f"px {strategy}, {args.ranks} ranks, rank {r}", res)
                     for r, res in enumerate(results)]
        drawn = run_ranks(_with_phalanx, args.ranks, timeout=600,
                          args=(None, "zero3", args.layers, args.d))
        rows += [(f"px zero3, {args.ranks} ranks, rank {r}, drawn", res)
                 for r, res in enumerate(drawn)]
        (one,) = run_ranks(_with_phalanx, 1, args=(directory, "ddp", args.layers, args.d),
                           timeout=600)
        rows.append(("px, one process", one))
        (plain,) = run_ranks(_with_torch, 1, args=(directory, args.layers, args.d), timeout=600)
        rows.append(("torch: Model() + load_state_dict(load_file())", plain))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"model: {args.layers} x Linear({args.d}, {args.d}), {model_bytes / MB:.1f} MB fp32, "
          f"{args.shards} file(s)")
    print(f"{'configuration':<48} {'peak rise MB':>12} {'/ model':>8} {'read MB':>9}")
    for name, res in rows:
        read = "" if res["read"] is None else f"{res['read'] / MB:.1f}"
        print(f"{name:<48} {res['rise'] / MB:>12.1f} {res['rise'] / model_bytes:>8.2f} "
              f"{read:>9}")


if __name__ == "__main__":
    main()
