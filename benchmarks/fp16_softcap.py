"""fp16 on a causal LM whose loss comes from fp32 soft-capped logits (Gemma-2's final logit
soft-capping, `logits = cap * tanh(logits / cap)` in fp32, then cross-entropy), against fp32 in
one process and against torch.amp's recipe (autocast fp16 + GradScaler) on the same model and
data: skipped steps, and the distance of the gradient norms and final parameters to fp32.

    .venv/bin/python benchmarks/fp16_softcap.py [--steps 10] [--world 1 2] [--strategy ddp]

HEAD_MUL=K multiplies the head's initial weights by K (default 8: logits of a trained LM's size,
so the softcap bites; larger K, larger gradients). Measured on torch 2.13 CPU (gloo), 10 steps,
AdamW lr 1e-3, K = 8, 2 ranks: GradScaler skips 0 steps, gradient norms within 1.0e-4 of
fp32's, parameters 1.1e-4; phalanx fp16 (ddp, zero2, zero3) skips 0, 1.4e-4, 9.9e-5 (before the
fix in model/loss_scaling.py: step 0 skipped, 2.1e-2 and 5.4e-3).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

import phalanx as px
from phalanx.testing import run_ranks

# The model and its data are the test's (tests/test_fp16_scaling.py), so the benchmark measures
# what the test pins.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_fp16_scaling import ROWS, SoftCapLM, tokens


def make_model(seed=0):
    torch.manual_seed(seed)
    model = SoftCapLM()
    with torch.no_grad():  # the scale of trained LM logits, so the softcap bites
        model.head.weight.mul_(float(os.environ.get("HEAD_MUL", 8.0)))
    return model


def grad_norm(params):
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params
                         if p.grad is not None))


def reference(steps, world, lr=1e-3):
    """fp32, one process, the global batch."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    norms = []
    for step in range(steps):
        x, y = tokens(step, ROWS * world)
        loss, _ = model(x, y)
        loss.backward()
        norms.append(grad_norm(model.parameters()))
        opt.step()
        opt.zero_grad()
    return norms, [p.detach().double().clone() for p in model.parameters()]


def gradscaler(steps, world, lr=1e-3):
    """torch.amp's recipe on the CPU: fp32 parameters, autocast fp16, GradScaler defaults
    (init 2**16, growth 2 every 2000 good steps, backoff 0.5), one process, the global batch."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    norms, skipped = [], 0
    for step in range(steps):
        x, y = tokens(step, ROWS * world)
        with torch.autocast("cpu", dtype=torch.float16):
            loss, _ = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(grad_norm(model.parameters()))
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        opt.zero_grad()
    return norms, [p.detach().double().clone() for p in model.parameters()], skipped


def phalanx_fp16(steps, strategy="ddp", lr=1e-3):
    """phalanx fp16 on this rank's rows of the global batch."""
    world, rank = px.world_size(), px.rank()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt = px.prepare(model, opt, strategy=strategy, precision="fp16")
    norms, scales = [], []
    for step in range(steps):
        x, y = tokens(step, ROWS * world)
        x, y = x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]
        loss, _ = model(x, y)
        loss.backward()
        scales.append(model.loss_scaler.scale)
        norms.append(px.clip_grad_norm_(model, float("inf"), norm_type=2.0).item())
        opt.step()
        opt.zero_grad()
    state = model.state_dict()  # the fp32 masters (zero3: gathered, a collective)
    params = [state[name].detach().double().clone() for name, _ in
              px.unwrap(model).named_parameters()]
    return norms, params, model.loss_scaler.skipped_steps, scales


def rel_gap(a, b):
    num = math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b)))
    return num / math.sqrt(sum(float(y.pow(2).sum()) for y in b))


def norm_gap(norms, want):
    gaps = [abs(n - w) / w for n, w in zip(norms, want) if math.isfinite(n)]
    return max(gaps) if gaps else float("inf")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--world", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--strategy", default="ddp")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for world in args.world:
        want_norms, want_params = reference(args.steps, world)
        amp_norms, amp_params, amp_skips = gradscaler(args.steps, world)
        out = run_ranks(phalanx_fp16, world, args=(args.steps, args.strategy), timeout=300)
        px_norms, px_params, px_skips, scales = out[0]
        print(f"world {world} ({args.strategy}), {args.steps} steps")
        print(f"  fp32 grad norms      {[f'{n:.4g}' for n in want_norms]}")
        print(f"  GradScaler norms     {[f'{n:.4g}' for n in amp_norms]}")
        print(f"  phalanx fp16 norms   {[f'{n:.4g}' for n in px_norms]}")
        print(f"  phalanx scales       {scales}")
        print(f"  GradScaler: skipped {amp_skips}, "
              f"max norm gap {norm_gap(amp_norms, want_norms):.3g}"
              f", final params gap {rel_gap(amp_params, want_params):.3g}")
        print(f"  phalanx:    skipped {px_skips}, max norm gap {norm_gap(px_norms, want_norms):.3g}"
              f", final params gap {rel_gap(px_params, want_params):.3g}")


if __name__ == "__main__":
    main()
