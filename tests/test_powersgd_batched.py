"""PowerSGD's batched products (engine/powersgd.py): matrices of one shape in one unit are
computed together (bmm, a batched QR, baddbmm), and must still each get their own factors,
error feedback and warm-start Q. Checked in float64 on 2 ranks against PowerSGD written out
per matrix in one process on the global batch's gradient (the trajectory depends on the ranks
only through their mean: [Note: PowerSGD's state depends only on means over ranks])."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import run_ranks

ROWS, STEPS, RANK = 12, 4, 2
SEED = 0x5EED  # Q at the first compressed step: randn(m, r) seeded SEED + 7919 * position


def _model():
    torch.manual_seed(3)
    layers = [nn.Linear(16, 32), nn.Tanh()]
    for _ in range(3):  # three 32 x 32 matrices: one group of three
        layers += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 4)).double()


def _batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return (torch.randn(ROWS, 16, generator=g, dtype=torch.float64),
            torch.randn(ROWS, 4, generator=g, dtype=torch.float64))


def _ranks():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, bucket_mb=25,  # one unit: every matrix in it
                            compression=px.PowerSGD(rank=RANK, start_step=0))
    rows = ROWS // px.world_size()
    mine = slice(px.rank() * rows, (px.rank() + 1) * rows)
    reports = []
    for step in range(STEPS):
        x, y = _batch(step)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        reports.append(px.step_stats(model))
    return [p.detach().clone() for p in px.unwrap(model).parameters()], reports


def _by_hand():
    """One process, the mean gradient, each compressed matrix on its own."""
    model = _model()
    params = list(model.parameters())
    errors, qs = {}, {}
    for step in range(STEPS):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for k, p in enumerate(params):
                n, m = (p.shape[0], p[0].numel()) if p.dim() == 2 else (0, 0)
                if not n or n * m < 2 * (n + m) * RANK:
                    continue  # sent whole: the mean gradient as it is
                if k not in qs:
                    g = torch.Generator().manual_seed(SEED + 7919 * k)
                    qs[k] = torch.randn(m, RANK, generator=g, dtype=torch.float64)
                big_m = p.grad + errors.get(k, 0)
                big_p = torch.linalg.qr(big_m @ qs[k])[0]
                qs[k] = big_m.T @ big_p
                p.grad = big_p @ qs[k].T
                errors[k] = big_m - p.grad
            for p in params:
                p -= 0.1 * p.grad
                p.grad = None
    return params


def test_matrices_of_one_shape_batched_equal_powersgd_matrix_by_matrix():
    want = _by_hand()
    for got, reports in run_ranks(_ranks, 2, timeout=90):
        for i, (a, b) in enumerate(zip(got, want)):
            err = ((a - b).abs().max() / b.abs().max()).item()
            assert err < 1e-12, (i, err)
        for report in reports:  # what compression cost and saved, every step
            assert report["powersgd/compute_s"] > 0
            assert report["powersgd/saved_bytes"] == \
                report["powersgd/dense_bytes"] - report["powersgd/bytes"] > 0
