"""`px.linear_cross_entropy`: a language model's loss without its logits.

[Note: a loss a vocabulary chunk at a time]
A causal LM's last step, `F.cross_entropy(head(hidden).float(), labels)`, makes the logits of
every token over the whole vocabulary, in the compute dtype and again in fp32, keeps the fp32
log-softmax for backward and makes the logits' gradient there: 12 bytes per token per
vocabulary entry at the start of backward (3.15 GB for 2048 tokens of Llama 3's 128256 entries,
more than a 4-bit base of the whole 8B model per card). None of it is needed at once.

`linear_cross_entropy(hidden, head, labels)` computes the same loss a slice of the vocabulary at
a time (`chunk` rows of the head's weight; by default as many as make a slice's fp32 logits
at most 2^24 elements, 64 MiB, `chunk_rows`):
- forward: each slice's logits (hidden @ W[slice]^T, in the compute dtype, then fp32) update a
  running maximum and sum of exponentials per token (the log-sum-exp over the vocabulary, one
  slice at a time, as FlashAttention does over keys) and pick out the target's logit; what is
  kept for backward is the hidden states and weight it was given (already kept by any head)
  and one fp32 log-sum-exp per token;
- backward: each slice's logits are made again, and softmax minus the one-hot target, times the
  loss's gradient per token, is that slice's logits' gradient, d. The weight's gradient for
  the slice's rows is d^T @ hidden, one product over every token, exactly the rows the whole
  product would make; the hidden states' gradient, the sum over slices of d @ W[slice], is
  added up in fp32 and returned in their dtype.
So at most one slice of logits exists at a time (in the compute dtype as the matmul makes it,
in fp32, turned into its softmax and gradient in place, and cast back), besides the weight's
gradient that any head makes. benchmarks/sliced_loss.py, Llama 3's 128256-entry vocabulary
over 1024 tokens (hidden 256, one thread of an AMD EPYC): the peak the loss adds, 1576 MB with
F.cross_entropy, 189 MB (fp32) and 180 MB (bf16) sliced, the weight's gradient included; time
1.18x (fp32) and 1.07x (bf16) the plain loss's. The backward computes the logits again:
one more head forward's FLOPs (2 x tokens x vocabulary x hidden), about 1/3 more for the head.
Liger-Kernel's fused linear cross entropy (Hsu et al. 2024, arXiv:2410.10989) cuts the tokens
into chunks and computes the gradients in the forward; cutting the vocabulary instead makes the
weight's gradient in one product per slice, with nothing added up in low precision.

The head is called once, as a module (its forward is this computation for that one call), so
whatever brackets its forward sees one ordinary call: zero3 gathers its weight before and frees
it after, and gathers it again when backward reaches the loss (see [Note: zero3's gather and
free] in engine/zero3.py); the gradient reaches the weight as autograd's, where phalanx's
hooks reduce it. A head that is not a plain linear map (a PEFT adapter around it, a 4-bit
weight) is refused: computing around its forward would drop what that forward adds.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["linear_cross_entropy", "chunk_rows", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 2 ** 24  # a slice's logits, tokens x rows, at most this many (64 MiB in fp32)
REDUCTIONS = ("mean", "sum", "none")


def chunk_rows(tokens: int, vocab: int, chunk: int | None = None) -> int:
    """Rows of the head's weight per slice: `chunk` if given, else as many as keep a slice's
    logits within CHUNK_ELEMENTS for `tokens` tokens (at least one, at most the vocabulary).
    The planner counts the same slice."""
    rows = chunk if chunk is not None else CHUNK_ELEMENTS // max(tokens, 1)
    return max(1, min(vocab, rows))


def _wide(dtype: torch.dtype) -> torch.dtype:
    """What the loss is computed in: fp32 for 16-bit logits, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def _logits(hidden, weight, bias, lo, hi):
    out = hidden @ weight[lo:hi].t()
    if bias is not None:
        out = out + bias[lo:hi]
    return out.to(_wide(out.dtype))


def _in_slice(labels, lo: int, hi: int):
    """(which labels fall in rows [lo, hi), each label's column in the slice, clamped where it
    does not): shapes that do not depend on the values, so no device waits for them to be
    read (a `nonzero` would wait, slice after slice) and a meta-device trace runs it."""
    here = (labels >= lo) & (labels < hi)
    return here, (labels - lo).clamp(0, hi - lo - 1)[:, None]


class _SlicedCrossEntropy(torch.autograd.Function):
    """Per-token losses of (N, H) hidden states, a (V, H) weight and (N,) labels; 0 where a
    label is `ignore_index`. See [Note: a loss a vocabulary chunk at a time]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index: int, rows: int):
        n, vocab = hidden.shape[0], weight.shape[0]
        wide = dict(dtype=_wide(hidden.dtype), device=hidden.device)
        running_max = torch.full((n,), float("-inf"), **wide)
        running_sum = torch.zeros(n, **wide)
        target = torch.zeros(n, **wide)
        for lo in range(0, vocab, rows):
            hi = min(vocab, lo + rows)
            logits = _logits(hidden, weight, bias, lo, hi)  # a fresh tensor: changed in place
            here, at = _in_slice(labels, lo, hi)
            target = torch.where(here, logits.gather(1, at).squeeze(1), target)
            peak = torch.maximum(running_max, logits.amax(dim=1))
            running_sum = (running_sum * torch.exp(running_max - peak)
                           + logits.sub_(peak[:, None]).exp_().sum(dim=1))
            running_max = peak
            del logits
        lse = running_max + torch.log(running_sum)
        keep = labels != ignore_index
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.rows, ctx.ignore_index = rows, ignore_index
        return torch.where(keep, lse - target, torch.zeros_like(lse))

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        rows = ctx.rows
        vocab = weight.shape[0]
        per_token = torch.where(labels != ctx.ignore_index, grad_losses,
                                torch.zeros_like(grad_losses))
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_bias = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.zeros(hidden.shape, dtype=_wide(hidden.dtype), device=hidden.device) \
            if want_hidden else None
        grad_weight = torch.empty_like(weight) if want_weight else None
        grad_bias = torch.empty_like(bias) if want_bias else None
        for lo in range(0, vocab, rows):
            hi = min(vocab, lo + rows)
            d = _logits(hidden, weight, bias, lo, hi).sub_(lse[:, None]).exp_()  # its softmax
            here, at = _in_slice(labels, lo, hi)
            d.scatter_add_(1, at, -here.to(d.dtype)[:, None])  # softmax minus the one-hot
            d *= per_token[:, None]
            if want_bias:
                grad_bias[lo:hi] = d.sum(dim=0)
            d = d.to(hidden.dtype)
            if want_weight:
                torch.mm(d.t(), hidden, out=grad_weight[lo:hi])
            if want_hidden:
                grad_hidden += d @ weight[lo:hi]
            del d
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _plain_linear(head) -> bool:
    """nn.Linear's own forward, on a plain weight: none of a subclass, none set on the instance
    (a hook library's wrapper), no 4-bit weight."""
    return isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward \
        and "forward" not in head.__dict__ \
        and type(head.weight) in (torch.Tensor, nn.Parameter)


def _called_as(module: nn.Module, forward, *args):
    """Call `module` once, with `forward` in place of its own for that call, so that the hooks
    around its forward (zero3's gather and free) run as for any call."""
    before = module.__dict__.get("forward")
    module.forward = forward
    try:
        return module(*args)
    finally:
        if before is None:
            del module.forward
        else:
            module.forward = before


def linear_cross_entropy(hidden: torch.Tensor, head, labels: torch.Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean",
                         chunk: int | None = None) -> torch.Tensor:
    """`F.cross_entropy(head(hidden).float().flatten(0, -2), labels.flatten(), ...)` without
    the logits: the log-sum-exp over the vocabulary is taken a slice of rows of the head at a
    time, and backward makes each slice's logits again for its gradients, so the loss holds one
    slice's logits instead of every token's over the whole vocabulary (Llama 3's 128256 entries
    at 2048 tokens: 3.15 GB at the start of backward, against one 2^24-element slice), for one
    more head forward's FLOPs. In float64 it equals F.cross_entropy and its gradients.

    hidden: (..., H) the states the head takes (a causal LM's are shifted by the caller, as its
        labels are: `hidden[:, :-1]`, `labels[:, 1:]`).
    head: the output layer, an `nn.Linear` (V, H) whose forward is nn.Linear's (it is called
        once, so a zero3 model gathers it as usual), or its weight, a (V, H) tensor (a head tied
        to the embedding: `model.embed.weight`, inside the model's forward).
    labels: (...) integer targets, `ignore_index` where no loss is taken (others outside
        [0, vocabulary) are not checked: a GPU would wait for their values, slice after slice).
    reduction: "mean" over the labels that count (as F.cross_entropy: NaN when none does),
        "sum", or "none" (a loss per label, in fp32, in labels' shape).
    chunk: vocabulary rows per slice; None: as many as keep a slice's fp32 logits within 2^24
        elements.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}; one of "
                         f"{', '.join(map(repr, REDUCTIONS))}")
    if isinstance(head, nn.Module):
        if not _plain_linear(head):
            raise TypeError(
                f"linear_cross_entropy: the head is a {type(head).__name__}, whose forward is "
                "not nn.Linear's (an adapter around it, or a weight stored 4-bit); computing "
                "the loss from its weight would leave out what its forward adds. Compute the "
                "loss from its output with F.cross_entropy, or keep the head a plain nn.Linear "
                "(a QLoRA base leaves the output layer in the compute dtype)")
        weight = head.weight
    elif isinstance(head, torch.Tensor):
        weight = head
    else:
        raise TypeError(f"linear_cross_entropy: head is a {type(head).__name__}; pass the "
                        "output nn.Linear or its (vocabulary, hidden) weight")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden states of width {hidden.shape[-1]} "
                         f"against a head weight of shape {tuple(weight.shape)}; the head maps "
                         "(..., hidden) to (..., vocabulary)")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: labels of shape {tuple(labels.shape)} for "
                         f"hidden states of shape {tuple(hidden.shape)}; one label per hidden "
                         "state (shift both for next-token prediction: hidden[:, :-1], "
                         "labels[:, 1:])")
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"linear_cross_entropy: labels are {labels.dtype}; class indices "
                        "(torch.long) are expected")
    flat_labels = labels.reshape(-1)
    rows = chunk_rows(flat_labels.numel(), weight.shape[0], chunk)

    device = hidden.device.type
    try:
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
            else None
        outside = torch.autocast(device, enabled=False)
    except RuntimeError:  # a device autocast does not know (the meta device of a trace)
        autocast, outside = None, contextlib.nullcontext()

    def compute(h, w, b):
        # under autocast the head's matmul would run in its dtype; made explicit here, with
        # autocast off inside, so that backward (which runs without it) computes the same
        if autocast is not None:
            h, w = h.to(autocast), w.to(autocast)
            b = b.to(autocast) if b is not None else None
        with outside:
            return _SlicedCrossEntropy.apply(h.reshape(-1, h.shape[-1]), w, b, flat_labels,
                                             ignore_index, rows)

    if isinstance(head, nn.Module):
        losses = _called_as(head, lambda h: compute(h, head.weight, head.bias), hidden)
    else:
        losses = compute(hidden, weight, None)
    if reduction == "none":
        return losses.reshape(labels.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (flat_labels != ignore_index).sum()

