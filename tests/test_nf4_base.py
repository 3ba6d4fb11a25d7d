"""`px.prepare(lora_model, opt, strategy="zero3", base_dtype="nf4")`: QLoRA's frozen base in
4-bit NF4 shards, gathered and dequantized while each layer computes ([Note: an NF4 base in
shards] in model/nf4_base.py).

Against one process whose base weights are torchao's `to_nf4` of the same weights, computed
with torchao's own `linear_nf4`: with the same batch on both ranks of a world of two (the
average of equal gradients is each one, exactly), the trained adapters equal bit for bit. Each
rank keeps half of the 4-bit bytes; the base is gone from the module's parameters; a checkpoint
of the adapters resumes at another world size; a meta build reading its files quantizes each
base weight as it is read; what cannot take it is refused on every rank.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import RanksFailed, run_ranks

torchao_quantization = pytest.importorskip("torchao.quantization")


class Lora(nn.Module):
    """A frozen base Linear with a LoRA adapter beside it (A drawn, B small, as after a few
    steps), as PEFT's LoRA layer computes it."""

    def __init__(self, i: int, o: int, r: int = 4):
        super().__init__()
        self.base = nn.Linear(i, o)
        self.base.requires_grad_(False)
        self.A = nn.Linear(i, r, bias=False)
        self.B = nn.Linear(r, o, bias=False)
        nn.init.normal_(self.B.weight, std=0.02)

    def forward(self, x):
        return self.base(x) + self.B(self.A(x)) * 2.0


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # base weights of 32768 elements: two of NF4's scale blocks (64 x 256) each
    return nn.Sequential(Lora(128, 256), nn.Tanh(), Lora(256, 128), nn.Tanh(), nn.Linear(128, 4))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 128, generator=g), torch.randn(6, 4, generator=g)


def train(model, opt, steps) -> None:
    """The steps numbered `steps`, each on its batch: the same batch on every rank."""
    for step in steps:
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def trainable(model) -> dict:
    """The trained parameters' values (a zero3 model's through its state_dict, which gathers
    them: between uses its parameters hold no values)."""
    names = [n for n, p in px.unwrap(model).named_parameters() if p.requires_grad]
    values = model.state_dict()
    return {n: values[n].detach().clone() for n in names}


def _reference(steps):
    model = make_model()
    for layer in (model[0], model[2]):
        weight = torchao_quantization.to_nf4(layer.base.weight.detach(), 64, 256)
        linear_nf4 = sys.modules[type(weight).__module__].linear_nf4  # torchao's, by its class
        bias = layer.base.bias
        layer.base.forward = lambda x, w=weight, b=bias, f=linear_nf4: f(x, w) + b
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train(model, opt, range(steps))
    return trainable(model)


def _sharded(steps, path=None, phase=None):
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = px.prepare(model, opt, strategy="zero3", base_dtype="nf4", bucket_mb=0.01)
    inner = px.unwrap(model)
    kept = [inner[i].base._phalanx_nf4.nbytes() for i in (0, 2)]
    names = [n for n, _ in inner.named_parameters()]
    first = 0
    if phase == "load":
        px.load(path, model=model, optimizer=opt)
        first = 2
    train(model, opt, range(first, steps))
    if phase == "save":
        px.save(path, model=model, optimizer=opt)
    return trainable(model), kept, names


def test_the_adapters_train_as_over_torchaos_nf4_in_one_process():
    want = run_ranks(_reference, 1, args=(3,), timeout=120)[0]
    for rank, (got, kept, names) in enumerate(run_ranks(_sharded, 2, args=(3,), timeout=120)):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {rank} {name}"
        # each rank keeps half of each weight's NF4 bytes: codes (2 a byte), an int8 scale
        # a block of 64, an fp32 factor a block of 64 x 256: 0.516 bytes an element
        full = 32768 // 2 + 32768 // 64 + 32768 // (64 * 256) * 4
        assert kept == [full // 2, full // 2], kept  # one block of 64 x 256 (padded: none)
        assert "0.base.weight" not in names and "0.base.bias" in names


def _quantized_slices():
    model = make_model()
    weights = [model[i].base.weight.detach().clone() for i in (0, 2)]
    model, _ = px.prepare(model, torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2), strategy="zero3",
        base_dtype="nf4")
    out = []
    for i, weight in zip((0, 2), weights):
        shard = px.unwrap(model)[i].base._phalanx_nf4
        whole = torchao_quantization.to_nf4(weight, 64, 256)
        gathered = shard.weight(torch.float32)
        out.append((torch.equal(gathered, whole.get_original_weight()),
                    torch.equal(shard.scaler_mean, whole.scaler_mean), shard.nbytes()))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_quantizes_its_slice_as_torchao_quantizes_the_whole(world):
    """Each rank codes only its own elements and gathers every block's absmax for the scales'
    mean ([Note: quantizing a slice] in model/nf4_base.py): the weight gathered from the slices
    is torchao's to_nf4 of the whole weight, bit for bit, mean included; at 3 ranks the third
    holds none of a weight's two blocks of 64 x 256 (only padding)."""
    for rank, found in enumerate(run_ranks(_quantized_slices, world, timeout=120)):
        for same, same_mean, kept in found:
            assert same and same_mean, (world, rank)
            assert kept == (32768 // 2 + 32768 // 64 + 32768 // (64 * 256) * 4) // 2


def test_an_adapter_checkpoint_resumes_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_sharded, 2, args=(2, path, "save"), timeout=120)
    want = run_ranks(_sharded, 2, args=(3,), timeout=120)[0][0]
    for got, _, _ in run_ranks(_sharded, 3, args=(3, path, "load"), timeout=120):
        for name in want:  # (g + g + g) / 3 may differ from g in its last bit
            assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7), name


def _refused(case):
    if case == "meta, drawn":
        with torch.device("meta"):
            model = make_model()
    else:
        model = make_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    if case == "zero2":
        px.prepare(model, opt, strategy="zero2", base_dtype="nf4")
    elif case == "meta, drawn":
        px.prepare(model, opt, strategy="zero3", base_dtype="nf4")
    else:
        px.prepare(model, opt, strategy="zero3", base_dtype="int4")


@pytest.mark.parametrize("case,words", [
    ("zero2", "base_dtype='nf4' keeps the frozen base in 4-bit shards"),
    ("int4", "base_dtype='int4': 'nf4'"),
    ("meta, drawn", "init=px.from_safetensors(path) (each weight read whole and quantized"),
])
def test_what_cannot_take_it_is_refused_on_every_rank(case, words):
    with pytest.raises(RanksFailed) as caught:
        run_ranks(_refused, 2, args=(case,), timeout=60)
    assert "2 of 2 ranks failed" in str(caught.value)
    assert words in str(caught.value)


def _from_files(path, steps=3):
    with torch.device("meta"):
        model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = px.prepare(model, opt, strategy="zero3", base_dtype="nf4", bucket_mb=0.01,
                            init=px.from_safetensors(path))
    train(model, opt, range(steps))
    return trainable(model)


def test_a_meta_build_quantizes_each_base_weight_as_it_is_read(tmp_path):
    """A zero3 model built on the meta device, its weights read from files: each base weight is
    read whole from its file, quantized and let go, one at a time; the training that follows is
    the one of the model built with its weights, bit for bit."""
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in make_model().state_dict().items()},
              str(tmp_path / "model.safetensors"))
    want = run_ranks(_sharded, 2, args=(3,), timeout=120)[0][0]
    for got in run_ranks(_from_files, 2, args=(str(tmp_path),), timeout=120):
        for name in want:
            assert torch.equal(got[name], want[name]), name
