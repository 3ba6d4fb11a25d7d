"""The planner against measurement: per-rank peak memory and communication bytes of real
training steps.

    .venv/bin/python benchmarks/plan_vs_measured.py            # CPU, gloo, 2 and 4 ranks
    .venv/bin/python benchmarks/plan_vs_measured.py --quick    # fewer cases
    .venv/bin/python benchmarks/plan_vs_measured.py --gpu      # one GPU: max_memory_allocated
    .venv/bin/python benchmarks/plan_vs_measured.py --only llama-47M-lora   # one model
    .venv/bin/python benchmarks/plan_vs_measured.py --only llama-47M-lora llama-47M-offload

CPU: for each model, strategy, precision and world size, real ranks (forked, gloo, one thread
each) build the model, `px.prepare` it, take one warm-up step, then take two measured steps. The
memory a rank used is its peak resident set (VmHWM, reset after warm-up) minus its resident set
before the model was built; the communication is the payload bytes the collectives layer
counted (`phalanx.comm.records.bytes_by_kind()`, summed over every live `Comm`), per step. Both
are compared with `px.plan(..., backend="gloo")` for the same setting: its total per device
(model states, activations, engine buffers) and its payload per step.
glibc is told to serve large allocations with mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors
leave the resident set at once instead of lingering in the heap.

A page joins the resident set when it is first written, while a GPU allocator charges a tensor
whole when it is made. The one place this differs here is ZeRO-2's pool of bucket buffers: made
up front and kept, but which of the three a bucket borrows depends on collective timing, so a
buffer may only ever serve small buckets, or none, and part of it is never written (on one rank
and not another). The measured peak therefore adds the pool's pages that are still not resident
after the run (mincore(2)): memory the engine allocated for the whole run, and the planner's
figure for a device.

Two things a CPU run has that the plan (made for GPUs) does not model: a bf16 matmul on CPU
(oneDNN) makes an fp32 scratch the size of its output, so the backward of a large bf16 weight
(a language-model head) briefly holds its gradient in fp32 as well; and a few MB of small
tensors, Python objects and gloo scratch. Where the peak is at the start of backward (bf16
zero1/zero2 here) the first shows as measured above planned.

Fine-tuning: llama-47M-lora is llama-47M frozen, with LoRA adapters of rank 8 beside its
attention's q and v projections (planner/finetune.py's `add_lora`, PEFT's layout), the optimizer
built over the adapters; it runs under ddp and zero2, where every rank holds the frozen
parameters whole in the compute dtype, and under zero3, which shards them with the adapters in
the units of the modules that hold them; it is planned as `px.plan(meta model, lora_rank=8,
lora_targets=("q", "v"))` plans it (the adapters added to a meta copy, activations traced).
llama-47M-offload is llama-47M trained with `offload="optimizer"` under zero2 and zero3: on a
CPU the engine's host and "device" buffers are both in this process's memory, so the measured
rise is compared with the plan's device peak plus its host memory per rank.

GPU: one process, the same comparison against `torch.cuda.max_memory_allocated()`, activations
included, for a GPT-2-small-size and a ~1B-parameter transformer in bf16 mixed precision.

The plan's engine buffers follow the engine's layout: reduced gradients stay in the compute
dtype (the kept bucket for ddp/zero1, a persistent shard for zero2), ZeRO-2's pool of three
bucket buffers is made up front, and under mixed precision the step makes the fp32 gradient of
one unit at a time (see [Note: Engine buffers] in src/phalanx/planner/memory.py).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import mmap
import os
import re
import sys
import time

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # must be set before the process starts
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.planner.finetune import add_lora
from phalanx.planner.reference_model import ReferenceTransformer
from phalanx.planner.transformer import shape_from_config
from phalanx.testing import run_ranks

# Dropout off: on CPU a dropout mask costs the activation's dtype, on GPU one byte, and the
# planner plans for GPUs.
CONFIGS = {
    "gpt-23M": {"model_type": "gpt2", "n_embd": 512, "n_layer": 6, "n_head": 8, "n_inner": None,
                "n_positions": 256, "vocab_size": 8192},
    "llama-47M": {"model_type": "llama", "hidden_size": 640, "num_hidden_layers": 8,
                  "num_attention_heads": 10, "num_key_value_heads": 5,
                  "intermediate_size": 1728, "vocab_size": 8000, "tie_word_embeddings": False},
}
GPU_CONFIGS = {
    "gpt2-small (124M)": ({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                           "n_inner": None, "n_positions": 1024, "vocab_size": 50257}, 8, 1024),
    "gpt-1.0B": ({"model_type": "gpt2", "n_embd": 2048, "n_layer": 18, "n_head": 16,
                  "n_inner": None, "n_positions": 1024, "vocab_size": 50257}, 2, 1024),
}
MLP_DIM = 1024
LORA_RANK, LORA_TARGETS = 8, ("q", "v")  # the reference model's attention projections


class MLP(nn.Module):
    """A plain residual MLP stack (no config: the planner traces it on the meta device)."""

    def __init__(self, blocks=4, dim=MLP_DIM):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(blocks))
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _base(name):
    """The model a fine-tuning or offload case trains (llama-47M-lora: llama-47M)."""
    return name.removesuffix("-lora").removesuffix("-offload")


def _offload(name):
    return "optimizer" if name.endswith("-offload") else None


def build(name, tiny=False):
    """The model; `tiny`: the same layers at a size that costs nothing (for warming up)."""
    torch.manual_seed(0)
    if name == "mlp-34M":
        return MLP(blocks=2, dim=MLP_DIM // 16) if tiny else MLP()
    config = CONFIGS[_base(name)]
    if tiny:
        shape = shape_from_config(config)
        config = dict(config, **{"n_layer" if "n_layer" in config else "num_hidden_layers": 2})
        config["vocab_size"] = shape.vocab // 16
    model = ReferenceTransformer(shape_from_config(config))
    if name.endswith("-lora"):
        add_lora(model, LORA_RANK, LORA_TARGETS)
    return model


def batch_for(name, batch, seq, device="cpu", tiny=False):
    if name == "mlp-34M":
        return torch.randn(batch * seq, MLP_DIM // (16 if tiny else 1), device=device), None
    vocab = shape_from_config(CONFIGS[_base(name)]).vocab // (16 if tiny else 1)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return ids, torch.randint(0, vocab, (batch, seq), device=device)


def loss_of(model, x, y):
    out = model(x)
    if y is None:
        return out.square().mean()
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _status_kb(key):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1)) * 1024


def _unwritten_bytes(tensors) -> int:
    """Bytes of the tensors' storages whose pages are not resident (never written)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = 0
    for t in tensors:
        start = t.data_ptr() // page * page
        end = t.data_ptr() + t.untyped_storage().nbytes()
        pages = -(-(end - start) // page)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        missing = sum(1 for v in vec if not v & 1)
        total += min(missing * page, t.untyped_storage().nbytes())
    return total


def _train(name, strategy, precision, data, tiny=False):
    model = build(name, tiny)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision,
                            offload=_offload(name))

    def step(x, y):
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()

    step(*data[0])  # warm-up: buckets are re-laid and optimizer state is created
    return step, model


def _measure_rank(name, strategy, precision, batch, seq, steps):
    from phalanx.comm.records import bytes_by_kind, reset_counts
    torch.manual_seed(px.rank())
    # The same layers at a tiny size first: the kernels' code is paged in and gloo's threads
    # and buffers are set up before the baseline is taken, so the difference is the model's.
    tiny = [batch_for(name, batch, seq, tiny=True) for _ in range(2)]
    _train(name, strategy, precision, tiny, tiny=True)[0](*tiny[1])
    gc.collect()
    data = [batch_for(name, batch, seq) for _ in range(steps + 1)]
    before = _status_kb("VmRSS")
    step, model = _train(name, strategy, precision, data)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current resident set
    reset_counts()
    for x, y in data[1:]:
        step(x, y)
    pool = getattr(model._engine, "pool", None)
    return {"peak": _status_kb("VmHWM") - before,
            "unwritten": _unwritten_bytes(pool.tensors()) if pool is not None else 0,
            "comm": {op: b / steps for op, b in bytes_by_kind().items()}}


def _plan_for(name, world, strategy, precision, batch, seq, gpu=False):
    # px.prepare's precision names are the planner's (phalanx.spec.precisions)
    common = dict(gpus=world, strategy=strategy, precision=precision, optimizer="adamw",
                  backend="nccl" if gpu else "gloo", gpu_memory="1000GB",
                  offload=None if gpu else _offload(name))
    if name == "mlp-34M":
        with torch.device("meta"):
            module = MLP()
        return px.plan(module, batch=batch * seq, seq=1, input_shape=str(MLP_DIM), **common)
    if name.endswith("-lora"):
        with torch.device("meta"):
            module = ReferenceTransformer(shape_from_config(CONFIGS[_base(name)]))
        return px.plan(module, batch=batch, seq=seq, lora_rank=LORA_RANK,
                       lora_targets=LORA_TARGETS, **common)
    config = GPU_CONFIGS[name][0] if gpu else CONFIGS[_base(name)]
    return px.plan(config=config, batch=batch, seq=seq, **common)


def _ratio(a, b):
    return a / b if b else float("nan")


STRATEGIES = {"llama-47M-lora": ("ddp", "zero2", "zero3"),
              "llama-47M-offload": ("zero2", "zero3")}
TWO_RANKS = ("llama-47M-lora", "llama-47M-offload")  # measured at 2 ranks only


def run_cpu(quick: bool, only: list[str] | None = None):
    models = ["gpt-23M", "mlp-34M"] if quick else ["gpt-23M", "llama-47M", "mlp-34M", *TWO_RANKS]
    models = only or models
    rows = []
    for name in models:
        batch, seq = (4, 8) if name == "mlp-34M" else (2, 64)
        strategies = STRATEGIES.get(name, ("ddp", "zero1", "zero2"))
        worlds = [2] if quick or name in TWO_RANKS else [2, 4]
        for world in worlds:
            for precision in ("fp32", "bf16"):
                for strategy in strategies:
                    start = time.time()
                    results = run_ranks(_measure_rank, world,
                                        args=(name, strategy, precision, batch, seq, 2),
                                        timeout=600)
                    plan = _plan_for(name, world, strategy, precision, batch, seq)[strategy]
                    # offload on a CPU: the host side is in the same memory
                    planned = plan.total_bytes + plan.host_bytes
                    top = max(results, key=lambda r: r["peak"] + r["unwritten"])
                    measured_peak, unwritten = top["peak"] + top["unwritten"], top["unwritten"]
                    counted = sum(results[0]["comm"].values())
                    planned_comm = sum(plan.comm_payload_bytes.values())
                    rows.append((name, strategy, precision, world, planned,
                                 measured_peak, planned_comm, counted, unwritten))
                    print(f"{name:10} {strategy:5} {precision:4} N={world}: memory planned "
                          f"{planned / 1e6:8.1f} MB measured {measured_peak / 1e6:8.1f} "
                          f"MB ({_ratio(planned, measured_peak):.3f}); comm planned "
                          f"{planned_comm / 1e6:7.1f} MB counted {counted / 1e6:7.1f} MB "
                          f"({_ratio(planned_comm, counted):.3f})  [pool never written: "
                          f"{unwritten / 1e6:.1f} MB; {time.time() - start:.0f} s]",
                          flush=True)
    return rows


def run_gpu():
    px.init()
    rows = []
    for name, (config, batch, seq) in GPU_CONFIGS.items():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = ReferenceTransformer(shape_from_config(config))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = px.prepare(model, opt, strategy="ddp", precision="bf16")
        vocab = config["vocab_size"]
        for i in range(3):
            if i == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(0, vocab, (batch, seq), device="cuda")
            loss_of(model, ids, torch.randint(0, vocab, (batch, seq), device="cuda")).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        plan = _plan_for(name, 1, "ddp", "bf16", batch, seq, gpu=True)["ddp"]
        rows.append((name, "ddp", "bf16", 1, plan.total_bytes, measured, 0, 0, 0))
        print(f"{name}: planned {plan.total_bytes / 1e9:.2f} GB (activations "
              f"{plan.activations_bytes / 1e9:.2f} GB), measured {measured / 1e9:.2f} GB "
              f"({_ratio(plan.total_bytes, measured):.3f})", flush=True)
        del model, opt
    return rows


def table(rows, gpu=False):
    head = ("| model | strategy | precision | ranks | planned peak | measured peak | ratio |"
            + ("" if gpu else " of which pool never written | planned comm/step | "
                              "counted comm/step | ratio |"))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, strategy, precision, world, planned, measured, pc, cc, unwritten in rows:
        line = (f"| {name} | {strategy} | {precision} | {world} | {planned / 1e6:.1f} MB | "
                f"{measured / 1e6:.1f} MB | {_ratio(planned, measured):.3f} |")
        if not gpu:
            line += (f" {unwritten / 1e6:.1f} MB | {pc / 1e6:.2f} MB | {cc / 1e6:.2f} MB | "
                     f"{_ratio(pc, cc):.3f} |")
        lines.append(line)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="measure on one CUDA GPU")
    ap.add_argument("--quick", action="store_true", help="fewer models and world sizes")
    ap.add_argument("--only", nargs="+", choices=[*CONFIGS, "mlp-34M", *TWO_RANKS],
                    help="these models' cases (llama-47M-lora, llama-47M-offload: at 2 ranks)")
    args = ap.parse_args()
    if args.gpu:
        if not torch.cuda.is_available():
            sys.exit("--gpu needs a CUDA GPU")
        rows = run_gpu()
    else:
        rows = run_cpu(args.quick, args.only)
    print()
    print(table(rows, gpu=args.gpu))
    worst = max(abs(_ratio(r[4], r[5]) - 1) for r in rows)
    print(f"\nlargest memory deviation: {worst:.1%} (target 10%)")


if __name__ == "__main__":
    main()
