"""Per-rank memory of model states for ddp, zero1 and zero2, beside the ZeRO paper's formula.

    .venv/bin/python benchmarks/memory.py            # 33.6M-parameter MLP, 2 and 4 ranks, CPU

Model states are the parameters, the gradients and the optimizer state (for fp32 AdamW: 4 + 4 +
8 bytes per parameter replicated). ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054) predicts
per rank, for Psi parameters on N ranks:

    fp32 AdamW           ddp 16 Psi    zero1 (8 + 8/N) Psi    zero2 (4 + 12/N) Psi
    mixed-precision Adam ddp 16 Psi    zero1 (4 + 12/N) Psi   zero2 (2 + 14/N) Psi

Measured: the bytes of every distinct storage that holds a model state on the rank (the model's
parameters and gradients, the strategy's flat buffers, masters and shard gradients, the
optimizer's state), sampled as each gradient arrives in backward and after forward, backward
and step, over three training steps. "Peak" is the largest sample; "steady" is after
`optimizer.zero_grad()`, between steps. Both are compared with the formula plus the buffers
that the configuration adds, which the table prints: ZeRO-2 lends its short-lived
full-gradient buckets from a pool of two buffers, each the largest unit that borrows one (up
to `bucket_mb`, 25 MiB by default; a unit of one parameter is reduced in the gradient autograd
made and borrows none), and mixed precision makes the fp32 gradient of one unit at a time
inside the step.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import run_ranks

MB = 2**20


def make_model(blocks=8, d=1024, hidden=2048):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                           for _ in range(blocks)])


def _state_tensors(model, optimizer):
    module = px.unwrap(model)
    yield from module.parameters()
    yield from (p.grad for p in module.parameters() if p.grad is not None)
    engine = model._engine
    for unit in engine.units:
        yield from (t for t in (unit.flat, unit.master, unit.grad_shard, unit.reduced)
                    if t is not None)
        for piece in unit.pieces:  # the optimizer's tensors (under mixed precision their fp32
            # gradients, made one unit at a time inside the step)
            yield from (t for t in (piece.master, piece.master.grad) if t is not None)
    for bucket in engine.reducer.buckets:
        yield from (t for t in (bucket.buffer, bucket.comm_buffer) if t is not None)
    if engine.pool is not None:  # zero2's idle bucket buffers
        yield from engine.pool.tensors()
    for state in optimizer.state.values():
        yield from (t for t in state.values() if torch.is_tensor(t))


def model_state_bytes(model, optimizer) -> int:
    storages = {}
    for t in _state_tensors(model, optimizer):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def measure(strategy, precision, bucket_mb):
    torch.set_num_threads(1)
    model = make_model()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = px.prepare(model, optimizer, strategy=strategy, precision=precision,
                                  bucket_mb=bucket_mb)
    samples = []
    sample = lambda *_: samples.append(model_state_bytes(model, optimizer))  # noqa: E731
    for p in px.unwrap(model).parameters():  # runs after phalanx's own hook on each parameter
        p.register_post_accumulate_grad_hook(sample)
    optimizer.register_step_pre_hook(sample)  # inside the step, with its fp32 gradients made
    steady = 0
    for _ in range(3):
        x = torch.randn(8, 1024)
        loss = F.mse_loss(model(x), torch.zeros(8, 1024))
        sample()
        loss.backward()
        sample()
        optimizer.step()
        sample()
        optimizer.zero_grad()
        steady = model_state_bytes(model, optimizer)
    # The configured buffers beyond the formula: zero2's pool of two bucket buffers (each the
    # largest unit that borrows, in the compute dtype) and, under mixed precision, the fp32
    # gradient of the units being stepped (see [Note: fp32 gradients a few units at a time] in
    # engine/units.py).
    engine = model._engine
    pool = engine.pool
    allowance = pool.keep * pool.numel * torch.empty((), dtype=pool.dtype).element_size() \
        if pool is not None else 0
    if precision != "fp32":
        allowance += 4 * max(u.hi - u.lo for u in engine.units)
    return n_params, max(samples), steady, allowance


FORMULA = {  # bytes per parameter as a function of N
    ("fp32", "ddp"): lambda n: 16, ("fp32", "zero1"): lambda n: 8 + 8 / n,
    ("fp32", "zero2"): lambda n: 4 + 12 / n,
    ("bf16", "ddp"): lambda n: 16, ("bf16", "zero1"): lambda n: 4 + 12 / n,
    ("bf16", "zero2"): lambda n: 2 + 14 / n,
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args(argv)
    print(f"{'precision':9s} {'strategy':8s} {'N':>2s} {'formula MiB':>11s} {'+buckets':>9s} "
          f"{'peak MiB':>9s} {'steady MiB':>10s} {'peak/(f+b)':>12s} {'steady/(f+b)':>14s}")
    for precision in args.precisions.split(","):
        for world in [int(w) for w in args.worlds.split(",")]:
            for strategy in ("ddp", "zero1", "zero2"):
                results = run_ranks(measure, world, args=(strategy, precision, args.bucket_mb),
                                    timeout=600)
                n_params = results[0][0]
                peak = max(r[1] for r in results)
                steady = max(r[2] for r in results)
                formula = FORMULA[(precision, strategy)](world) * n_params
                allowance = results[0][3]
                print(f"{precision:9s} {strategy:8s} {world:2d} {formula / MB:11.1f} "
                      f"{allowance / MB:9.1f} {peak / MB:9.1f} {steady / MB:10.1f} "
                      f"{peak / (formula + allowance):12.3f} "
                      f"{steady / (formula + allowance):14.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
