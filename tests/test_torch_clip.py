"""torch.nn.utils.clip_grad_norm_ on a prepared model: routed to phalanx's global norm while a
model needs it, with every argument honoured, and torch's own function again afterwards."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.clip_grad as clip_mod

import phalanx as px
from phalanx.testing import run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _routed_and_restored():
    original = torch.nn.utils.clip_grad_norm_
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy="zero2", on_nonfinite=None)
    routed = torch.nn.utils.clip_grad_norm_ is not original \
        and clip_mod.clip_grad_norm_ is not original
    x = torch.randn(3, 4, dtype=torch.float64)
    F.mse_loss(model(x), torch.zeros(3, 2, dtype=torch.float64)).backward()
    want = px.clip_grad_norm_(model, 1e9).item()  # the global norm (nothing clipped at 1e9)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item()
    clipped = px.clip_grad_norm_(model, 1e9).item()
    # another tensor's clip reaches torch's function with every argument (foreach too)
    other = torch.zeros(3, requires_grad=True)
    other.grad = torch.tensor([3.0, 4.0, 0.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        bad = torch.zeros(2, requires_grad=True)
        bad.grad = torch.tensor([float("inf"), 1.0])
        torch.nn.utils.clip_grad_norm_([bad], 1.0, error_if_nonfinite=True, foreach=False)
    plain = torch.nn.utils.clip_grad_norm_([other], 1.0, foreach=True).item()
    # the prepared model's own non-finite norm raises when asked, as torch's does
    x_inf = torch.full((3, 4), 1e308, dtype=torch.float64)
    opt.zero_grad()
    F.mse_loss(model(x_inf) * 1e308, torch.zeros(3, 2, dtype=torch.float64)).backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        raised = False
    except RuntimeError as exc:
        raised = "non-finite" in str(exc)
    del model, opt
    gc.collect()
    px.barrier()  # a dropped sharded model is freed at the next blocking collective
    gc.collect()  # ([Note: a model dropped while a peer reads it] in engine/remote.py)
    restored_when_freed = torch.nn.utils.clip_grad_norm_ is original
    model, opt = px.prepare(_model(), None, strategy="ddp", precision="fp32")
    px.shutdown()
    return routed, (norm, clipped), want, plain, raised, restored_when_freed, \
        torch.nn.utils.clip_grad_norm_ is original


def test_torch_clip_is_routed_while_needed_and_honours_every_argument():
    for routed, norm, want, plain, raised, freed, after in run_ranks(_routed_and_restored, 2):
        assert routed
        norm, clipped = norm
        assert norm == pytest.approx(want, rel=1e-12) and norm > 1e-3
        assert clipped == pytest.approx(1e-3, rel=1e-5)  # torch's call clipped phalanx's shards
        assert plain == pytest.approx(5.0)
        assert raised, "error_if_nonfinite=True was ignored for a prepared model"
        assert freed, "torch's clip was not given back once no prepared model needed it"
        assert after
