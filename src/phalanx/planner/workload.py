"""The work of one step on one device: activation bytes of a micro-batch and training FLOPs.

[Note: FLOPs of frozen weights]
A matrix weight costs 2 FLOPs per token forward, 2 for the gradient of its input and 2 for its
own gradient: 6 in all when it learns, 4 when it is frozen (autograd computes no gradient for
it, and still the input's, which the layers below need). So training is 3 x forward less 2 per
frozen weight per token: from a config 6 x matmul weights - 2 x the frozen ones (+ attention,
12 x layers x seq x hidden), from a bare count 4 x parameters + 2 x the trainable ones, from a
traced module forward x (2 + trainable / parameters) (frozen weights taken as matmul weights).
With activation checkpointing the forward runs once more.
"""

from __future__ import annotations

import torch

from ..model.linear_loss import chunk_rows
from .model_desc import ModelDesc
from .trace import trace_module

__all__ = ["activations_and_flops", "loss_bytes"]


def _frozen_note(desc: ModelDesc) -> list[str]:
    if desc.frozen_params <= 0:
        return []
    return [f"{desc.frozen_params:,} frozen parameters: 4 FLOPs per weight per token, "
            "not 6 (no weight gradient)"]


def activations_and_flops(desc: ModelDesc, prec, batch, seq, grad_accum, checkpointing,
                          attention, notes, sliced: bool = False):
    """Activation bytes of one micro-batch (saved tensors plus the loss's gradients at the start
    of backward, when memory peaks) and training FLOPs of one step on one device (see
    [Note: FLOPs of frozen weights]). `sliced`: the loss is px.linear_cross_entropy's (from a
    config; a module's traced forward computes whichever loss it computes)."""
    def training(forward, skipped, per):
        """Training FLOPs of a step, from the forward's and the skipped weight gradients'
        FLOPs per `per` (a token, or a micro-batch)."""
        return (3 * forward - skipped + (forward if checkpointing else 0)) * per

    if desc.transformer is not None:
        shape = desc.transformer
        elem = prec.activation_bytes
        acts = shape.activation_bytes(batch, seq, elem, checkpointing, attention, sliced=sliced)
        acts += shape.loss_transient_bytes(batch, seq, sliced, elem)
        adapters = (desc.finetune or {}).get("adapter_params", 0)
        # the sliced loss makes the head's logits again in backward: one more head forward
        per_token = shape.flops_per_token(seq) + 6 * adapters \
            + (2 * shape.vocab * shape.hidden if sliced else 0)
        skipped = 2 * desc.frozen_share * shape.matmul_params()
        notes.append("compute is 6 x matmul weights x tokens + 12 x layers x seq x hidden per "
                     "token for attention (PaLM, Chowdhery et al. 2022, App. B)"
                     + (", x 4/3 for recomputation" if checkpointing else ""))
        if sliced:
            notes.append("sliced_loss: px.linear_cross_entropy keeps one fp32 log-sum-exp per "
                         f"token and works on {chunk_rows(batch * seq, shape.vocab):,} rows of "
                         "the head at a time; backward makes the logits again (one more head "
                         "forward)")
        notes.extend(_frozen_note(desc))
        return acts, training(per_token / 3, skipped, batch * seq * grad_accum)
    fallback = training(2.0 * desc.params, 2.0 * desc.frozen_params, batch * seq * grad_accum)
    if desc.module is None or desc.make_input is None:
        if desc.source == "count":
            notes.append("compute is 6 x parameters x tokens (Kaplan et al. 2020), attention "
                         "FLOPs excluded")
            notes.extend(_frozen_note(desc))
        return 0, fallback
    try:
        with torch.device("meta"):
            inputs = desc.make_input(batch, seq)
        traced = trace_module(desc.module, inputs, prec.compute_dtype or torch.float32)
    except Exception as exc:  # noqa: BLE001 - a forward that fails on meta: say so, go on
        first = (str(exc).strip().splitlines() or [""])[0]
        notes.append(f"activations not traced (the forward failed on the meta device: "
                     f"{type(exc).__name__}: {first[:200]}); compute is 6 x parameters x tokens")
        return 0, fallback
    if checkpointing and not traced.blocks:
        notes.append("no repeated blocks (nn.ModuleList) found: activation checkpointing is "
                     "not modelled")
    if sliced:
        notes.append("sliced_loss is planned from a config; a module's traced forward "
                     "computes the loss it computes")
    acts = traced.checkpointed_bytes if checkpointing else traced.activation_bytes
    acts += traced.loss_transient_bytes
    notes.append("compute is 3 x the forward FLOPs counted on the meta device"
                 + (" (4 x with recomputation)" if checkpointing else ""))
    notes.extend(_frozen_note(desc))
    forward = traced.forward_flops
    return acts, training(forward, forward * desc.frozen_params / max(desc.params, 1), grad_accum)


def loss_bytes(desc: ModelDesc, batch: int, seq: int, sliced: bool = False,
               elem: int = 2) -> int:
    """Of a micro-batch's activations, the loss's memory that its own backward frees before any
    weight has a gradient (a config's log-softmax and its gradients, or the sliced loss's:
    transformer.py's `loss_bytes`); 0 where it is not known apart (a module's traced forward,
    a count)."""
    if desc.transformer is None:
        return 0
    return desc.transformer.loss_bytes(batch, seq, sliced, elem)
