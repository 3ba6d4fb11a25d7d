"""Step time of a PEFT LoRA Llama and of its full fine-tune, phalanx zero3 beside FSDP2, one run.

    .venv/bin/python benchmarks/lora_steps.py                # parity check, then 7 timed rounds
    .venv/bin/python benchmarks/lora_steps.py --rounds 11 --steps 3
    .venv/bin/python benchmarks/lora_steps.py --check        # the parity check alone (seconds)

Needs transformers and peft. The model is benchmarks/lora_memory.py's Llama (46.4M parameters),
from the same builder: with LoRA adapters of rank 8 on q_proj and v_proj and AdamW over the
adapters, or bare for a full fine-tune (every parameter trainable, AdamW over all). 2 ranks, CPU,
gloo, 1 thread each, 2 rows of 64 tokens per rank per step.

Competitors: phalanx `px.prepare(model, opt, strategy="zero3", precision=p)`, and FSDP2:
`fully_shard` on each decoder layer, then on the model, under bf16 with
`MixedPrecisionPolicy(param_dtype=torch.bfloat16)`; each under fp32 and bf16, for LoRA and for
the full fine-tune: 8 models, all built in the same two processes, which live for the whole run.
After the warm-up rounds, every round runs each competitor for `--steps` steps, in an order
rotated by one each round (no competitor always runs first, or after the same one); a
competitor's time in a round is the slowest rank's mean step. Reported: each competitor's
median over the rounds, and the median over rounds of zero3's step / FSDP2's step in the same
round (same task, same precision), beside the smallest and largest of those ratios.

The parity check runs first, in processes of its own: a tiny Llama of the same shape (float64,
fp32 precision, LR 1e-2 so that the adapters move from their zero start) trains 3 steps under
zero3 and under FSDP2, for LoRA and for the full fine-tune; the loss of every step on every rank
must agree within 1e-10, and must change over the steps, or the script stops.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from lora_memory import LLAMA, ROWS, TOKENS, lora_llama

import phalanx as px
from phalanx.testing import run_ranks

TASKS, PRECISIONS, SYSTEMS = ("LoRA", "full"), ("fp32", "bf16"), ("zero3", "FSDP2")
COMPETITORS = [(task, precision, system) for task in TASKS for precision in PRECISIONS
               for system in SYSTEMS]
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4)
PARITY_TOLERANCE = 1e-10


def build(task, precision, system, lr=1e-4, dtype=None, **sizes):
    """One competitor: the model (LoRA or bare) and its AdamW, prepared by zero3 or FSDP2."""
    model = lora_llama(lora=task == "LoRA", **sizes)
    if dtype is not None:
        model.to(dtype)
    def adamw():
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    if system == "zero3":
        return px.prepare(model, adamw(), strategy="zero3", precision=precision)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" \
        else MixedPrecisionPolicy()
    llama = model.base_model.model if task == "LoRA" else model
    for layer in llama.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, adamw()  # after fully_shard, which replaces the parameters by its own


def step(model, optimizer, tokens) -> float:
    # The loss of next-token prediction, in the logits' dtype (transformers' own casts float64
    # logits to float32, which would cost the parity check its float64 precision).
    logits = model(input_ids=tokens).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def batches(count, vocab, rows=ROWS, tokens=TOKENS):
    g = torch.Generator().manual_seed(1000 + px.rank())  # each rank its own rows
    return [torch.randint(0, vocab, (rows, tokens), generator=g) for _ in range(count)]


def parity_rank():
    """Each task's per-step losses on this rank, under each system (float64, tiny Llama)."""
    data = batches(3, TINY["vocab_size"], tokens=16)
    out = {}
    for task in TASKS:
        for system in SYSTEMS:
            model, optimizer = build(task, "fp32", system, lr=1e-2, dtype=torch.float64, **TINY)
            out[task, system] = [step(model, optimizer, tokens) for tokens in data]
    return out


def check_parity(world):
    ranks = run_ranks(parity_rank, world, timeout=600)
    for task in TASKS:
        gap = max(abs(a - b) for losses in ranks
                  for a, b in zip(losses[task, "zero3"], losses[task, "FSDP2"]))
        moved = min(abs(losses[task, "zero3"][-1] - losses[task, "zero3"][0]) for losses in ranks)
        print(f"parity, {task}: float64 losses of 3 steps x {world} ranks, zero3 - FSDP2 at most "
              f"{gap:.1e} (tolerance {PARITY_TOLERANCE:.0e}); the loss moved by at least "
              f"{moved:.2e}", flush=True)
        if not gap <= PARITY_TOLERANCE or moved < 1e-6:
            sys.exit(f"parity check failed for {task}: zero3 and FSDP2 do not train the same "
                     f"model to the same loss")


def time_rank(rounds, steps, warmup):
    built = {c: build(*c) for c in COMPETITORS}
    data = batches(steps, LLAMA["vocab_size"])
    times = {c: [] for c in COMPETITORS}
    for r in range(-warmup, rounds):
        k = r % len(COMPETITORS)
        for c in COMPETITORS[k:] + COMPETITORS[:k]:
            dist.barrier()
            start = time.perf_counter()
            for tokens in data:
                step(*built[c], tokens)
            elapsed = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if r >= 0:
                times[c].append(elapsed.item())
    return times


def setup_line() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown CPU")
    here = Path(__file__).parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "lora_steps.py",
                            "lora_memory.py"], cwd=here, capture_output=True, text=True).stdout
    return (f"{cpu}, {os.cpu_count()} cores (1 thread per rank), torch "
            f"{torch.__version__}, commit {commit}{' (benchmark files modified)' if dirty else ''}"
            f"\ncommand: {' '.join([Path(sys.executable).name, *sys.argv])}")


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2, help="steps per competitor per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="run the parity check alone")
    args = parser.parse_args(argv)
    print(setup_line(), flush=True)
    check_parity(args.world)
    if args.check:
        return
    before = load()
    times = run_ranks(time_rank, args.world, args=(args.rounds, args.steps, args.warmup),
                      timeout=3600)[0]
    print(f"load average (1, 5, 15 min) before the timed rounds {before}, after {load()}")
    print(f"\nstep time, median of {args.rounds} rounds x {args.steps} steps after {args.warmup} "
          f"warm-up round(s), {args.world} ranks, interleaved in one run")
    print(f"{'task':<5} {'prec':<5} {'zero3 ms':>9} {'FSDP2 ms':>9} {'zero3/FSDP2':>12} "
          f"{'(min, max)':>14}")
    for task in TASKS:
        for precision in PRECISIONS:
            ours, theirs = times[task, precision, "zero3"], times[task, precision, "FSDP2"]
            ratios = [a / b for a, b in zip(ours, theirs)]
            print(f"{task:<5} {precision:<5} {1e3 * statistics.median(ours):9.1f} "
                  f"{1e3 * statistics.median(theirs):9.1f} {statistics.median(ratios):12.3f} "
                  f"  ({min(ratios):.3f}, {max(ratios):.3f})")


if __name__ == "__main__":
    main()
