"""QLoRA's base under zero3: `px.prepare(lora_model, opt, strategy="zero3", base_dtype="nf4")`.

[Note: an NF4 base in shards]
QLoRA (Dettmers et al. 2023, arXiv:2305.14314) keeps the frozen base weights in NF4: 4-bit
codes for a normal distribution's quantiles, one absmax scale per block of 64 elements, the
scales themselves quantized to int8 in blocks of 256 around their mean ("double quantization").
torchao's `NF4Tensor` (pure PyTorch: it runs on a CPU) holds that layout; phalanx uses it as it
is and shards it:

- Each frozen 2-D weight of an nn.Linear is quantized as torchao's `to_nf4` quantizes it (the
  same codes, scales and mean as in one process: tests/test_nf4_base.py), each rank quantizing
  only its slice: the elements [r*S, (r+1)*S) of the flattened weight, S a whole number of
  scale blocks (64 x 256 elements), so a slice's codes, scales and scales' factors are its own
  (the last rank's slice padded); the scales' mean, the one value that reads the whole weight,
  comes from every block's absmax, gathered ([Note: quantizing a slice]). What stays is 1/N of
  the 4-bit bytes. A zero3 model built on the meta
  device with `init=px.from_safetensors(path)` never holds a base weight otherwise: each is
  read from its file whole, quantized, and let go, one at a time (pretrained.py's
  `take_whole`).
- The weight is no longer a parameter of its module (zero3's units never see it): the module's
  forward gathers the three arrays (about 0.52 bytes per element, a quarter of bf16's, on a
  group of their own), dequantizes the whole weight in the compute dtype for its matmul and
  lets it go; backward gathers and dequantizes it again for the input's gradient
  (`_ShardedNF4Linear`), so no rank holds more than one layer's bf16 weight at a time.
- The trainable parameters (LoRA's A and B, norms, whatever requires grad) are zero3's as
  always, in the precision asked for.

What is not converted stays as it was (and says so in `convert`'s return): frozen weights whose
size is not a whole number of scale blocks (64 x 256 elements), any frozen parameter that is
not an nn.Linear's weight (embeddings, norms, biases), and the output layer (engine/units.py's
`output_layer`: Hugging Face's `get_output_embeddings()`, else the last nn.Linear outside the
repeated blocks), which bitsandbytes leaves in the compute dtype too: quantizing the logits'
weights costs the most accuracy for the least memory (a twentieth of an 8B model), and a loss
computed from the head's weight a slice at a time (px.linear_cross_entropy) needs it plain.
The base weights converted are not in the model's state_dict (a QLoRA checkpoint holds the
adapters; `px.export(..., adapter=True)` writes them as PEFT does); a merged export of an NF4
base is refused (checkpoint/lora.py).
"""

from __future__ import annotations

import math
import sys
import types

import torch
import torch.nn.functional as F

from ..engine.units import output_layer
from .materialize import has_room

__all__ = ["convert", "NF4Shard", "BLOCK", "SCALER_BLOCK"]

BLOCK, SCALER_BLOCK = 64, 256
CHUNK = BLOCK * SCALER_BLOCK  # the elements of one scales' block: a slice is a number of them


def _nf4_module():
    """torchao's NF4 module (its NF4Tensor class, the quantization's static steps, the tensor
    metadata it is built from), found through its public `to_nf4`."""
    try:
        from torchao.quantization import to_nf4
    except ImportError:
        raise ImportError("base_dtype='nf4' stores the frozen base with torchao's NF4Tensor: "
                          "pip install torchao (or phalanx[lowbit])") from None
    return sys.modules[to_nf4.__module__]


class NF4Shard:
    """This rank's slice of one weight's NF4 arrays (see the Note), and how to gather it.

    [Note: quantizing a slice]
    torchao's NF4 (`NF4Tensor.from_tensor`) codes each element against its block of 64's
    absmax, which the slice holds whole; only the scales' second quantization reads every
    block: their mean, and each block of 256 scales' absmax around it. So each rank codes its own
    elements with torchao's own step (`convert_to_norm_float_weight`), gathers every block's
    absmax (1/64 of the weight's elements) and runs torchao's double quantization of the scales
    over all of them, exactly as over the whole weight (a block of one element's absmax is the
    value itself): the codes, scales, factors and mean are bit for bit the whole weight's
    (tests/test_nf4_base.py compares the gathered weight and mean with torchao's own `to_nf4`
    at 2 and 3 ranks, and trains against it at 2)."""

    def __init__(self, weight: torch.Tensor, comm):
        nf4 = _nf4_module()
        cls = nf4.NF4Tensor
        flat = weight.detach().contiguous().flatten()
        self.comm, self.cls = comm, cls
        self.shape, self.dtype, self.numel = weight.shape, weight.dtype, flat.numel()
        self.meta = nf4.SubclassTensorArgs(weight.size(), weight.stride(),
                                           weight.storage_offset(), weight.dtype, weight.device,
                                           False)
        self.per = math.ceil(self.numel // CHUNK / comm.world)  # scale blocks' blocks per rank
        lo = min(comm.rank * self.per * CHUNK, self.numel)
        mine = flat[lo:min(lo + self.per * CHUNK, self.numel)]
        self.nf4 = nf4.to_nf4(torch.zeros(CHUNK, dtype=weight.dtype, device=weight.device),
                              BLOCK, SCALER_BLOCK).nf4  # the 16 code values, as torchao makes them
        codes = cls.convert_to_norm_float_weight(mine, mine.numel() // BLOCK, BLOCK, self.nf4) \
            if mine.numel() else torch.empty(0, dtype=torch.uint8, device=weight.device)
        absmax = torch.zeros(self.per * CHUNK // BLOCK, dtype=weight.dtype, device=weight.device)
        if mine.numel():
            absmax[:mine.numel() // BLOCK] = nf4.get_block_absmax(mine, BLOCK)
        every = torch.empty(absmax.numel() * comm.world, dtype=weight.dtype, device=weight.device)
        comm.all_gather_into(every.view(torch.uint8), absmax.view(torch.uint8), tag="nf4:scales")
        scales, factors, self.scaler_mean = cls.double_quantize_scalers(
            every[:self.numel // BLOCK], 1, SCALER_BLOCK)
        # (codes: 2 a byte; scales: 1 a block of 64; factors: 1 a block of 64 x 256)
        self.parts = [_padded(codes, 0, self.per * CHUNK // 2),
                      _padded(scales, lo // BLOCK, (lo + self.per * CHUNK) // BLOCK),
                      _padded(factors, lo // CHUNK, lo // CHUNK + self.per)]

    def nbytes(self) -> int:
        """What this rank keeps of the weight."""
        return sum(t.numel() * t.element_size() for t in self.parts)

    @torch.no_grad()
    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight, gathered from every rank's slice and dequantized to `dtype`."""
        whole = []
        for part, keep in zip(self.parts, (self.numel // 2, self.numel // BLOCK,
                                           self.numel // CHUNK)):
            out = torch.empty(part.numel() * self.comm.world, dtype=part.dtype,
                              device=part.device)
            self.comm.all_gather_into(out, part, tag="nf4:gather")
            whole.append(out[:keep])
        nf4 = self.cls(self.meta, BLOCK, self.numel // BLOCK, SCALER_BLOCK, whole[1], whole[2],
                       self.scaler_mean, whole[0], self.nf4)
        return nf4.get_original_weight().to(dtype)


def _padded(values: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """values[lo:hi], zero-padded to hi - lo (the last ranks' slices)."""
    out = torch.zeros(hi - lo, dtype=values.dtype, device=values.device)
    piece = values[lo:hi]
    out[:piece.numel()] = piece
    return out


class _ShardedNF4Linear(torch.autograd.Function):
    """y = x W^T with W gathered and dequantized in forward, and again in backward for the
    input's gradient (W is frozen: no gradient of its own)."""

    @staticmethod
    def forward(ctx, x, shard: NF4Shard):
        ctx.shard = shard
        return F.linear(x, shard.weight(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.shard.weight(grad.dtype), None


def _forward(self, x):
    y = _ShardedNF4Linear.apply(x, self._phalanx_nf4)
    return y + self.bias if self.bias is not None else y


def convert(module: torch.nn.Module, comm, read=None, block_classes=None) -> dict:
    """Store every frozen nn.Linear weight of `module` that takes it as NF4 in shards (see the
    Note): {"converted": names, "kept": {name: why}}. `read(path, "weight")`: the whole value
    of a weight that holds none yet (a zero3 meta build reading pretrained files:
    pretrained.py's `take_whole`), read one weight at a time and quantized as it is read.
    `block_classes`: px.prepare's `blocks=`, which decides the output layer of a model without
    `get_output_embeddings()` (engine/units.py's `output_layer`) as the planner decides it."""
    converted, kept = [], {}
    names = {id(p): n for n, p in module.named_parameters()}
    output = output_layer(module, block_classes)  # px.prepare's blocks=, as the planner's
    for path, sub in module.named_modules():
        if not isinstance(sub, torch.nn.Linear):
            continue
        w = sub.weight
        name = names.get(id(w), "weight")
        if w.requires_grad:
            continue
        if sub is output:
            kept[name] = "the output layer, kept in the compute dtype"
            continue
        if w.numel() % CHUNK:
            kept[name] = f"{w.numel()} elements, not a whole number of {CHUNK}"
            continue
        value = w if has_room(w) else (read(path, "weight") if read is not None else None)
        if value is None:
            kept[name] = "no values to quantize (a meta build with no file holding it)"
            continue
        shard = NF4Shard(value.to(w.device), comm)
        del sub._parameters["weight"]
        sub._phalanx_nf4 = shard
        sub.weight = None  # F.linear's argument goes through the shard
        sub.forward = types.MethodType(_forward, sub)
        converted.append(name)
    return {"converted": converted, "kept": kept}
