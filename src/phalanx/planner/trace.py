"""Activation bytes and FLOPs of an arbitrary `nn.Module`, from one forward on the meta device.

The meta device runs the real operators with shapes and dtypes but no data, so autograd saves
exactly the tensors it would save on a GPU, and nothing is allocated. A
`torch.autograd.graph.saved_tensors_hooks` pair sees every tensor saved for backward; its
storage is counted once (views of one storage share it) and parameters and buffers are left
out: they are model states, not activations. `torch.utils.flop_counter.FlopCounterMode` counts
the forward FLOPs on the same pass; training is taken as 3x forward (backward ~ 2x forward), 4x
with activation checkpointing.

Activation checkpointing is modelled per repeated block, the children of the module's largest
`nn.ModuleList` (transformer layers, ResNet stages...): each block keeps only its inputs, and
during backward one block at a time is recomputed in full. The loss is not part of the module;
it is assumed to save one fp32 tensor of the output's size (as cross-entropy's log-softmax and
MSE's difference do), and to need two more at the start of backward (the gradients flowing back
into the output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from ..engine.units import find_blocks

__all__ = ["TraceResult", "trace_module", "find_blocks"]


@dataclass(frozen=True)
class TraceResult:
    activation_bytes: int     # saved for backward, no checkpointing, loss included
    checkpointed_bytes: int   # with per-block activation checkpointing
    loss_transient_bytes: int  # the loss's gradients at the start of backward
    forward_flops: float
    blocks: int               # repeated blocks found (0: checkpointing not modelled)


def _to_meta(x, dtype):
    if isinstance(x, torch.Tensor):
        d = dtype if x.is_floating_point() else x.dtype
        return torch.empty(x.shape, dtype=d, device="meta", requires_grad=x.requires_grad)
    if isinstance(x, (tuple, list)):
        return type(x)(_to_meta(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v, dtype) for k, v in x.items()}
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def trace_module(module: nn.Module, inputs: tuple, dtype: torch.dtype) -> TraceResult:
    """Run `module(*inputs)` on the meta device in `dtype`; count saved bytes and FLOPs."""
    state = {}
    for name, p in module.named_parameters():  # tied weights once; functional_call ties the rest
        state[name] = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype,
                                  device="meta", requires_grad=p.requires_grad)
    for name, b in module.named_buffers():
        state[name] = _to_meta(b, dtype)
    excluded = {t.untyped_storage()._cdata for t in state.values()}
    inputs = _to_meta(tuple(inputs), dtype)

    blocks = find_blocks(module)
    current = [None]
    saved = {"outer": 0}
    block_inputs = 0
    keep = []  # hold counted storages so their ids stay unique for the whole pass
    seen = set()

    def pack(t):
        s = t.untyped_storage()
        key = s._cdata
        if key not in excluded and key not in seen:
            seen.add(key)
            keep.append(s)
            where = current[0] if current[0] is not None else "outer"
            saved[where] = saved.get(where, 0) + s.nbytes()
        return t

    def pre_hook(index):
        def hook(_mod, args, kwargs):
            nonlocal block_inputs
            if current[0] is None:
                block_inputs += sum(t.numel() * t.element_size() for t in _tensors((args, kwargs))
                                    if t.is_floating_point())
            current[0] = index if current[0] is None else current[0]
        return hook

    def post_hook(index):
        def hook(_mod, _args, _kwargs, _out):
            if current[0] == index:
                current[0] = None
        return hook

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(block.register_forward_hook(post_hook(i), with_kwargs=True))
    try:
        with torch.device("meta"), FlopCounterMode(display=False) as flops, \
                saved_tensors_hooks(pack, lambda t: t):
            out = functional_call(module, state, inputs)
    finally:
        for h in handles:
            h.remove()
    # The loss: one fp32 tensor the size of the (first floating) output.
    loss_bytes = next((4 * t.numel() for t in _tensors(out) if t.is_floating_point()), 0)
    outer = saved.pop("outer") + loss_bytes
    total = outer + sum(saved.values())
    if blocks:
        checkpointed = outer + block_inputs + max(saved.values(), default=0)
    else:
        checkpointed = total
    return TraceResult(activation_bytes=total, checkpointed_bytes=checkpointed,
                       loss_transient_bytes=2 * loss_bytes,
                       forward_flops=float(flops.get_total_flops()), blocks=len(blocks))
