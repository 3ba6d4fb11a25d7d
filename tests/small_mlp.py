"""The small MLP, its data and a relative error, shared by the tests that compare a prepared
model with plain PyTorch in one process (test_low_precision.py, test_optimizer_state_dict.py,
test_torch_idioms.py, test_failed_backward.py, test_prepare_options.py, test_replica_check.py).

`batch(step, rows)` is the same global batch on every rank; `rank_rows(x, y)` is this rank's
ROWS rows of it, so N ranks together hold what one process with N*ROWS rows holds.
"""

import torch
import torch.nn as nn

import phalanx as px

STRATEGIES = ["ddp", "zero1", "zero2"]
ROWS = 4  # rows per rank


def batch(step, rows, dim=6, out=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(rows, dim, generator=g, dtype=dtype),
            torch.randn(rows, out, generator=g, dtype=dtype))


def rank_rows(x, y):
    lo = ROWS * px.rank()
    return x[lo:lo + ROWS], y[lo:lo + ROWS]


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).to(dtype)


def rel_err(a, b):
    """max |a - b| / max |b|, the relative error of a whole tensor."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
