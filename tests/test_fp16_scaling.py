"""fp16's loss scaling against torch.amp's recipe, on real ranks: a causal LM whose loss comes
from fp32 soft-capped logits (Hugging Face's Gemma-2 shape: `cap * tanh(logits / cap)` in fp32,
then cross-entropy) trained 10 steps under phalanx fp16 on 2 ranks skips no more steps than
autocast fp16 + GradScaler (its defaults: init 2**16, growth 2 every 2000 steps, backoff 0.5) on
the same model and global batch, and ends as close to fp32.

The defect (issue: "fp16 ... skipped a step ... and drifted from fp32's gradient norm"): each
rank's gradients carried the whole loss scale, and the ranks' fp16 gradients are averaged by
summing them in fp16 first (gloo's AVG), so the sum of two ranks' scaled gradients overflowed
where their mean, and GradScaler's gradient of the global batch, did not. See [Note: the ranks'
sum must fit in fp16] in model/loss_scaling.py.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import one_thread

import phalanx as px
from phalanx.model.loss_scaling import DynamicLossScaler
from phalanx.testing import run_ranks

VOCAB, DIM, SEQ, ROWS, CAP, STEPS, LR = 64, 32, 16, 4, 30.0, 10, 1e-3
WORLD = 2
FP16_MAX = torch.finfo(torch.float16).max


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class SoftCapLM(nn.Module):
    """Embedding, two MLP blocks (each position mixed with the mean of those up to it: causal),
    final norm, head; the logits are cast to fp32 and soft-capped there, then cross-entropy.
    Returns (loss, logits), as Hugging Face's causal LMs do."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        positions = torch.arange(1, h.shape[1] + 1, dtype=h.dtype)
        h = h + h.cumsum(1) / positions[:, None]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h)).float()
        logits = CAP * torch.tanh(logits / CAP)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1)), logits


def make_model():
    torch.manual_seed(0)
    model = SoftCapLM()
    with torch.no_grad():
        model.head.weight.mul_(8.0)  # logits of a trained LM's size, so the softcap bites
    return model


def tokens(step, rows):
    g = torch.Generator().manual_seed(500 + step)
    seq = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _norm(params):
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params
                         if p.grad is not None))


def _params(named):
    return [t.detach().double().clone() for _, t in named]


def _fp32():
    """One process, fp32, the global batch of WORLD * ROWS rows."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        loss, _ = model(*tokens(step, WORLD * ROWS))
        loss.backward()
        norms.append(_norm(model.parameters()))
        opt.step()
        opt.zero_grad()
    return norms, _params(model.named_parameters()), 0


def _gradscaler():
    """torch.amp's recipe on the same model and global batch: autocast fp16, GradScaler."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    norms, skipped = [], 0
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            loss, _ = model(*tokens(step, WORLD * ROWS))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(_norm(model.parameters()))
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        opt.zero_grad()
    return norms, _params(model.named_parameters()), skipped


def _phalanx_fp16():
    """phalanx fp16 under ddp (all-reduce) and zero2 (reduce to shards), this rank's rows."""
    out = {}
    lo = px.rank() * ROWS
    for strategy in ("ddp", "zero2"):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        model, opt = px.prepare(model, opt, strategy=strategy, precision="fp16")
        norms = []
        for step in range(STEPS):
            x, y = tokens(step, px.world_size() * ROWS)
            loss, _ = model(x[lo:lo + ROWS], y[lo:lo + ROWS])
            loss.backward()
            norms.append(px.clip_grad_norm_(model, float("inf")).item())  # the norm, no clip
            opt.step()
            opt.zero_grad()
        state = model.state_dict()  # the fp32 masters
        names = [name for name, _ in px.unwrap(model).named_parameters()]
        out[strategy] = (norms, _params((n, state[n]) for n in names),
                         model.loss_scaler.skipped_steps)
    return out


def _param_gap(params, want):
    """|params - want| / |want| over all parameters together."""
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(params, want))
    return math.sqrt(num / sum(float(b.pow(2).sum()) for b in want))


def _norm_gap(norms, want):
    """The largest relative gap of a finite gradient norm to fp32's."""
    return max((abs(a - b) / b for a, b in zip(norms, want) if math.isfinite(a)), default=0.0)


@pytest.mark.one_process
def test_the_case_needs_the_ranks_sum_to_fit():
    """The model is one where it matters: at the first step each rank's gradient times 2**16
    fits in fp16, and its sum over the two ranks does not (the mean does)."""
    with one_thread():
        model = make_model()
        x, y = tokens(0, WORLD * ROWS)
        grads = []
        for rank in range(WORLD):
            model.zero_grad()
            model(x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS])[0].backward()
            grads.append(torch.cat([p.grad.flatten() * 2.0**16 for p in model.parameters()]))
    assert all(g.abs().max() < FP16_MAX for g in grads)
    assert (grads[0] + grads[1]).abs().max() > FP16_MAX
    assert ((grads[0] + grads[1]) / 2).abs().max() < FP16_MAX


def test_fp16_on_two_ranks_skips_no_more_and_stays_as_close_to_fp32_as_gradscaler():
    """Measured (torch 2.13 CPU, gloo): GradScaler skips 0 steps, its gradient norms are within
    1.0e-4 of fp32's and its parameters 1.1e-4 after 10 steps; phalanx (ddp and zero2) skips 0,
    1.4e-4 and 9.9e-5. Before the fix phalanx skipped step 0 (norm inf) and ended 2.1e-2 and
    5.4e-3 away, 200 and 49 times GradScaler's. The margin below is 2x."""
    with one_thread():
        want_norms, want_params, _ = _fp32()
        amp_norms, amp_params, amp_skipped = _gradscaler()
    amp_norm_gap = _norm_gap(amp_norms, want_norms)
    amp_param_gap = _param_gap(amp_params, want_params)
    results = run_ranks(_phalanx_fp16, WORLD, timeout=60)
    for rank, by_strategy in enumerate(results):
        for strategy, (norms, params, skipped) in by_strategy.items():
            context = f"fp16 {strategy} rank {rank}"
            assert skipped <= amp_skipped, (
                f"{context}: skipped {skipped} of {STEPS} steps, GradScaler {amp_skipped} "
                f"(gradient norms {norms})")
            norm_gap = _norm_gap(norms, want_norms)
            assert norm_gap <= 2 * amp_norm_gap, (
                f"{context}: gradient norms up to {norm_gap:.3g} off fp32's, GradScaler's "
                f"{amp_norm_gap:.3g}")
            param_gap = _param_gap(params, want_params)
            assert param_gap <= 2 * amp_param_gap, (
                f"{context}: parameters {param_gap:.3g} off fp32's after {STEPS} steps, "
                f"GradScaler's {amp_param_gap:.3g}")


@pytest.mark.one_process
def test_the_scale_per_rank_is_the_loss_scale_over_a_power_of_two():
    """What each rank's gradients carry (`scale`) is the loss scale divided by the smallest
    power of two >= the ranks (exact to multiply and undo); the schedule and checkpoints move
    the loss scale, the same at every world size."""
    for ranks, divisor in [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8)]:
        scaler = DynamicLossScaler(ranks=ranks)
        assert scaler.loss_scale == 2.0**16 and scaler.scale == 2.0**16 / divisor
        scaler.update(found_inf=True)
        assert scaler.loss_scale == 2.0**15 and scaler.scale == 2.0**15 / divisor
        assert scaler.state_dict()["scale"] == 2.0**15
        other = DynamicLossScaler(ranks=1)
        other.load_state_dict(scaler.state_dict())
        assert other.scale == 2.0**15 and other.skipped_steps == 1
