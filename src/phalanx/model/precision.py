"""Precision in one place: compute, communication and output dtypes, and fp16's loss scaler.

    precision  parameters in forward/backward   masters and optimizer state   loss scaling
    fp32       the parameters' own dtype        the parameters themselves     none
    bf16       bfloat16                         the parameters' dtype (fp32)  none
    fp16       float16                          the parameters' dtype (fp32)  dynamic
    bf16-true  bfloat16                         bfloat16, no master copy      none

("fp32" means no low precision: an fp64 model stays fp64.) Under bf16/fp16, floating inputs
are cast to the compute dtype on the way in and floating outputs to fp32 on the way out, as
PyTorch's FSDP2 `MixedPrecisionPolicy(cast_forward_inputs=True, output_dtype=float32)` does
(and Accelerate's mixed precision), so a loss computed from them is computed in fp32.
`px.prepare(output_dtype=None)` leaves the outputs in the compute dtype, FSDP2's default: the
fp32 copy of a large output (a language model's logits: 4 bytes per vocabulary entry per
token, 1.6 GB for nanoGPT's batch of 8 x 1024 tokens x 50304) is then never made.

What is cast, and why:
- trainable parameters: their flat buffers are in the compute dtype (engine/flat.py);
- frozen parameters: cast too, since they meet the trainable ones in the same layers (a frozen
  embedding feeding bf16 matmuls); their low bits are not kept;
- buffers: they keep their dtype (a rotary embedding's `inv_freq` is kept in fp32 on purpose:
  in bf16 its angles at position 4096 are wrong by up to 0.7 in cos), except the buffers of a
  module that itself holds cast parameters, such as BatchNorm, whose kernels need one dtype for
  weights and running statistics (measured: torch 2.13 CPU batch_norm raises "expected scalar
  type BFloat16 but found Float" with bf16 weights and fp32 running statistics). FSDP2 casts no
  buffers at all; autocast casts nothing in place.

[Note: a float buffer meets low-precision compute under autocast]
A buffer kept in fp32 still meets bf16 activations: minGPT passes its float causal mask buffer
as `attn_mask` to `nn.MultiheadAttention`, whose `baddbmm(mask, q, k)` raised "Input dtypes must
be the same" with bf16 queries. So under bf16/fp16 the prepared forward runs under
`torch.autocast(device_type, dtype=compute_dtype)` (`Precision.compute`), beside the cast
parameters: autocast casts an fp32 buffer for the ops that need one dtype (matmuls, attention,
convolutions), so a model that trains under the script's own autocast trains under
precision="bf16". Autocast has nothing to cast for the parameters (already bf16), and runs its
fp32 ops in fp32, as an autocast run does (on CPU few ops, the losses such as cross_entropy
and mse_loss; on CUDA also softmax, layer_norm and others: https://pytorch.org/docs/stable/
amp.html#cuda-ops-that-can-autocast-to-float32), whose activations are then fp32. A rotary
embedding's fp32 product stays fp32 (Hugging Face computes it with autocast disabled).
Considered: casting float buffers (inv_freq loses its precision, above); casting floating
inputs at each module holding cast parameters (FSDP2's per-module input cast), which misses a
buffer used by an op inside its own module. Measured (AMD EPYC, 1 thread, torch 2.13, a
4-block GPT of width 256 with its loss inside forward, batch 8 x 128, world of one, steps
interleaved): a step's CPU time with autocast is 1.013 and 1.046 of without (two runs, median
of 57 paired steps); wall time was within the noise of the loaded 2-core machine (0.99, 1.05).

`comm_dtype` compresses what gradients travel as; the mean lands back in the gradients' own
dtype. None sends the gradients' dtype (the compute dtype).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..spec.precisions import PrecisionSpec
from ..world import runtime
from .loss_scaling import DynamicLossScaler
from .materialize import has_room

__all__ = ["Precision", "COMM_DTYPES", "make_precision", "cast_model"]

COMM_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
               torch.bfloat16: torch.bfloat16, torch.float16: torch.float16,
               torch.float32: torch.float32}


@dataclass(eq=False)
class Precision:
    name: str
    compute_dtype: torch.dtype | None   # None: each parameter's own dtype
    comm_dtype: torch.dtype | None      # None: the gradients' own dtype
    loss_scaler: DynamicLossScaler | None
    output_dtype: torch.dtype | None = torch.float32  # None: the compute dtype
    rounding: str | None = None  # bf16-true: the fp32 step's rounding (engine/rounding.py)

    @property
    def low(self) -> bool:
        return self.compute_dtype is not None

    def compute(self, device_type: str):
        """The context the prepared forward runs in: autocast to the compute dtype under
        bf16/fp16 (see the module docstring), nothing otherwise."""
        if not self.low:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def cast_input(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.compute_dtype) if self.low and t.is_floating_point() else t

    def cast_output(self, t: torch.Tensor) -> torch.Tensor:
        if self.low and self.output_dtype is not None and t.is_floating_point():
            return t.to(self.output_dtype)
        return t


def make_precision(spec: PrecisionSpec, comm_dtype, output_dtype=torch.float32,
                   ranks: int | None = None) -> Precision:
    """`ranks`: how many ranks average the gradients (the model's Comm's world size; None: the
    job's). Under fp16, when the gradients travel in fp16 their sum over the ranks must fit too,
    so each rank's share of the loss scale is divided by it (see [Note: the ranks' sum must fit
    in fp16] in loss_scaling.py); the job's world size is never smaller than a group's, so it is
    a safe bound where the Comm's is not given."""
    compute = spec.compute_dtype
    comm = COMM_DTYPES[comm_dtype]
    scaler = None
    if spec.loss_scaling:
        summed_in_fp16 = (comm if comm is not None else compute) == torch.float16
        if ranks is None:
            ranks = runtime.world_size() if summed_in_fp16 else 1
        scaler = DynamicLossScaler(ranks=ranks if summed_in_fp16 else 1)
    return Precision(spec.name, compute, comm, scaler, output_dtype, spec.rounding)


@torch.no_grad()
def cast_model(module: torch.nn.Module, precision: Precision) -> None:
    """Cast frozen parameters, and the buffers of modules holding cast parameters (see above).
    A zero3 parameter of a meta build that has no room for values yet (model/materialize.py)
    gets the new dtype and still no room."""
    if not precision.low:
        return
    for sub in module.modules():
        own = list(sub.parameters(recurse=False))
        for p in own:
            # bf16-true: the trained parameters too, their own masters (engine/rounding.py)
            if (not p.requires_grad or precision.rounding is not None) and p.is_floating_point():
                p.data = p.data.to(precision.compute_dtype) if has_room(p) else \
                    torch.empty((), dtype=precision.compute_dtype, device=p.device).expand(p.shape)
        if any(p.is_floating_point() for p in own):
            for name, b in sub.named_buffers(recurse=False):
                if b is not None and b.is_floating_point():
                    setattr(sub, name, b.to(precision.compute_dtype))
