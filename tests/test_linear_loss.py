"""`px.linear_cross_entropy`: the loss of F.cross_entropy over a head's logits, computed a slice
of the vocabulary at a time ([Note: a loss a vocabulary chunk at a time] in
model/linear_loss.py). In float64 it equals the plain loss and its gradients for any slice, with
a bias, ignored labels and every reduction; no tensor it makes is larger than one slice of
logits; a small LM computing it in its forward trains under every strategy (zero3 gathering the
head for it) as one process with the plain loss does; what it cannot compute is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import phalanx as px
from phalanx.model.linear_loss import CHUNK_ELEMENTS, chunk_rows
from phalanx.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
from parity import with_reference

V, H = 37, 16


def _plain(hidden, head, labels, **kw):
    logits = head(hidden) if isinstance(head, nn.Module) else hidden @ head.t()
    wide = torch.promote_types(logits.dtype, torch.float32)
    out = F.cross_entropy(logits.to(wide).flatten(0, -2), labels.flatten(), **kw)
    return out.reshape(labels.shape) if kw.get("reduction") == "none" else out


def _case(bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    head = nn.Linear(H, V, bias=bias).double()
    hidden = torch.randn(3, 5, H, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (3, 5))
    labels[0, 1] = labels[2, 4] = -100
    return head, hidden, labels


def _grads(loss, tensors):
    weights = torch.randn(loss.shape, dtype=loss.dtype, generator=torch.Generator().manual_seed(5))
    return torch.autograd.grad((loss * weights).sum(), tensors)


@pytest.mark.one_process
@pytest.mark.parametrize("chunk", [1, 7, V, None])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_the_plain_loss_in_float64(chunk, reduction, bias):
    head, hidden, labels = _case(bias)
    tensors = [hidden, *head.parameters()]
    plain = _plain(hidden, head, labels, reduction=reduction)
    sliced = px.linear_cross_entropy(hidden, head, labels, reduction=reduction, chunk=chunk)
    assert sliced.dtype == torch.float64 and sliced.shape == plain.shape
    assert (sliced - plain).abs().max().item() < 1e-13
    for a, b in zip(_grads(sliced, tensors), _grads(plain, tensors)):
        assert (a - b).abs().max().item() < 1e-13


@pytest.mark.one_process
def test_a_weight_tensor_as_the_head():
    head, hidden, labels = _case(False)
    w = head.weight.detach().clone().requires_grad_(True)
    plain = _plain(hidden, w, labels)
    sliced = px.linear_cross_entropy(hidden, w, labels, chunk=4)
    assert (sliced - plain).abs().item() < 1e-13
    for a, b in zip(_grads(sliced, [hidden, w]), _grads(plain, [hidden, w])):
        assert (a - b).abs().max().item() < 1e-13


class _Sizes(TorchDispatchMode):
    """The largest floating-point tensor any operation makes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.one_process
def test_no_tensor_is_larger_than_a_slice_of_logits():
    """64 tokens over a 4096-entry vocabulary, slices of 128 rows: the plain loss makes
    64 x 4096 logits; the sliced one nothing over 64 x 128 besides the head's own weight and
    its gradient (4096 x 16)."""
    torch.manual_seed(0)
    head = nn.Linear(16, 4096, bias=False)
    hidden = torch.randn(64, 16, requires_grad=True)
    labels = torch.randint(0, 4096, (64,))
    for fn, bound in ((lambda: _plain(hidden, head, labels), 64 * 4096),
                      (lambda: px.linear_cross_entropy(hidden, head, labels, chunk=128),
                       4096 * 16)):
        with _Sizes() as sizes:
            fn().backward()
        assert sizes.largest == bound, (sizes.largest, bound)
    assert chunk_rows(64, 4096, 128) == 128
    assert chunk_rows(2048, 128256) == CHUNK_ELEMENTS // 2048 == 8192  # Llama 3, 2048 tokens
    assert chunk_rows(10**9, 50) == 1 and chunk_rows(1, 50) == 50


class TinyLM(nn.Module):
    def __init__(self, vocab=V, hidden=H, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, sliced=True):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        x = self.norm(x)[:, :-1]
        if sliced:
            return px.linear_cross_entropy(x, self.head, ids[:, 1:], chunk=5)
        return _plain(x, self.head, ids[:, 1:])


def _train(strategy, steps=3, step_in_backward=False):
    torch.manual_seed(0)
    model, reference, opt, ref_opt = with_reference(lambda: TinyLM().double())
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=0.001,
                            step_in_backward=step_in_backward)
    world, r = px.world_size(), px.rank()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, V, (2 * world, 9), generator=g)
        loss = model(ids[2 * r:2 * r + 2])
        loss.backward()
        with torch.no_grad():
            losses.append(loss.item() - reference(ids[2 * r:2 * r + 2], sliced=False).item())
        opt.step()
        opt.zero_grad()
        reference(ids, sliced=False).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ours = px.unwrap(model).state_dict() if strategy != "zero3" else None
    with torch.no_grad():
        probe = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(7))
        out = model(probe, sliced=False).item() - reference(probe, sliced=False).item()
    weights = 0.0 if ours is None else max(
        (ours[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return max(map(abs, losses)), abs(out), weights


@pytest.mark.parametrize("strategy, in_backward", [("ddp", False), ("zero2", False),
                                                    ("zero3", False), ("zero3", True)])
def test_trains_as_one_process_with_the_plain_loss(strategy, in_backward):
    """Each rank computes the sliced loss of its half of the batch inside the model's forward;
    one process the plain loss of the whole batch: the losses, the weights (zero3: the model's
    output on a probe batch, each rank reading its peers' shards) agree in float64."""
    for rank, (loss, probe, weights) in enumerate(
            run_ranks(_train, 2, args=(strategy, 3, in_backward), timeout=120)):
        assert loss < 1e-12 and probe < 1e-12 and weights < 1e-12, (rank, loss, probe, weights)


@pytest.mark.one_process
@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16])
def test_under_autocast_backward_computes_what_forward_did(head_dtype):
    """Under autocast (as a prepared model's bf16 forward runs) the head's matmul is in bf16
    whatever the head's and the states' dtypes; backward, which runs without autocast, computes
    in the same dtype (fp32 states with a bf16 head once failed there): the loss and gradients
    are the plain loss's under autocast, to bf16's round-off."""
    torch.manual_seed(0)
    head = nn.Linear(H, V).to(head_dtype)
    hidden = torch.randn(10, H, requires_grad=True)
    labels = torch.randint(0, V, (10,))
    tensors = [hidden, *head.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sliced = px.linear_cross_entropy(hidden, head, labels, chunk=5)
        plain = F.cross_entropy(head(hidden).float(), labels)
    assert abs(sliced.item() - plain.item()) < 1e-2 * abs(plain.item())
    for a, b in zip(torch.autograd.grad(sliced, tensors), torch.autograd.grad(plain, tensors)):
        assert a.dtype == b.dtype and (a - b).abs().max().item() < 1e-2, (a - b).abs().max()


class _Adapted(nn.Linear):
    """A head whose forward adds something to the linear map, as an adapter's does."""

    def forward(self, x):
        return super().forward(x) + 1.0


@pytest.mark.one_process
def test_what_it_cannot_compute_is_refused():
    head, hidden, labels = _case(False)
    with pytest.raises(TypeError, match="not nn.Linear's.*F.cross_entropy"):
        px.linear_cross_entropy(hidden, _Adapted(H, V).double(), labels)
    with pytest.raises(TypeError, match="pass the output nn.Linear"):
        px.linear_cross_entropy(hidden, "head", labels)
    with pytest.raises(ValueError, match="one label per hidden state.*labels\\[:, 1:\\]"):
        px.linear_cross_entropy(hidden, head, labels[:, 1:])
    with pytest.raises(ValueError, match="width 8 against a head weight of shape \\(37, 16\\)"):
        px.linear_cross_entropy(hidden[..., :8], head, labels)
    with pytest.raises(TypeError, match="class indices"):
        px.linear_cross_entropy(hidden, head, labels.double())
    with pytest.raises(ValueError, match="reduction='avg'"):
        px.linear_cross_entropy(hidden, head, labels, reduction="avg")
    with pytest.raises(TypeError, match="not nn.Linear's"):
        px.linear_cross_entropy(hidden, nn.Sequential(head), labels)
    wrapped = nn.Linear(H, V).double()  # a hook library's wrapper set on the instance
    wrapped.forward = lambda x: nn.Linear.forward(wrapped, x) + 1.0
    with pytest.raises(TypeError, match="not nn.Linear's"):
        px.linear_cross_entropy(hidden, wrapped, labels)


@pytest.mark.one_process
def test_the_planner_traces_a_model_that_computes_it():
    """The shapes it makes do not depend on the labels' values (no `nonzero`: no device waits
    for them), so a model whose forward returns it is traced on the meta device like any."""
    plan = px.plan(TinyLM(), gpus=2, strategy="zero3", input_shape="9", input_dtype="long")
    assert not any("not traced" in note for note in plan.notes), plan.notes
    assert plan["zero3"].activations_bytes > 0
