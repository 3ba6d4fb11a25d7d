"""At most one read of a device value by the host per optimizer step (see [Note: one host read
per step] in engine/flat_engine.py), for every strategy and precision.

On a GPU each such read stops the host until the device catches up. On this CPU machine the
count is the proxy: every method that hands a tensor's value to Python (`.item()`, `.tolist()`,
`bool(t)`, `float(t)`, `int(t)`, `torch.equal`, ...) is wrapped to count its calls from the
training thread during a steady step (forward, backward, optimizer step, zero_grad), with the
step report and the non-finite check on (their defaults). SGD with momentum keeps no step
counter, so the optimizer's own bookkeeping is not counted.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.comm import host
from phalanx.testing import run_ranks

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


@contextlib.contextmanager
def counting_reads():
    main, counts = threading.get_ident(), [0]

    def wrap(fn):
        def counted(*args, **kwargs):
            if threading.get_ident() == main:
                counts[0] += 1
            return fn(*args, **kwargs)
        return counted

    saved = {name: getattr(torch.Tensor, name) for name in READS}
    saved_equal = torch.equal
    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(fn))
    torch.equal = wrap(saved_equal)
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.equal = saved_equal


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _reads_per_step(strategy, precision, micro_steps):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision,
                            bucket_mb=0.002)  # several units, several buckets

    def step():
        for micro in range(micro_steps):
            x, y = torch.randn(4, 8), torch.randn(4, 2)
            with px.no_sync(model) if micro < micro_steps - 1 else contextlib.nullcontext():
                F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # the first step broadcasts the launch order: not a steady step
        step()
    counted = []
    for _ in range(3):
        before = host.count()
        with counting_reads() as counts:
            step()
        counted.append((counts[0], host.count() - before))
    return counted


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_at_most_one_host_read_per_step(strategy, precision):
    for rank, counted in enumerate(run_ranks(_reads_per_step, 2, args=(strategy, precision, 1),
                                             timeout=120)):
        for reads, through_helper in counted:
            assert reads <= 1, f"{strategy} {precision} rank {rank}: {counted}"
            assert reads == through_helper, f"a read outside host.read: {counted}"


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_at_most_one_host_read_per_step_with_accumulation(strategy):
    for counted in run_ranks(_reads_per_step, 2, args=(strategy, "bf16", 3), timeout=120):
        assert all(reads <= 1 for reads, _ in counted), counted
