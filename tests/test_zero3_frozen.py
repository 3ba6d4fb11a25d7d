"""zero3 shards frozen parameters like trainable ones, in units that mix the two (the shape of a
LoRA model: a frozen projection with a trainable low-rank pair beside it, a frozen embedding
alone, trainable norms and head). Against one process, in float64: every strategy trains the
same, `state_dict()` gives the frozen parameters whole (on one rank alone too), a load through
`px.unwrap(model)` sets them, checkpoints move between zero3 and ddp, `px.export` and
`px.from_safetensors` read and write them whole; and between uses a zero3 rank holds 1/N of
them (test_zero3_peft.py does the same with PEFT's own LoRA model).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from parity import one_thread
from test_from_safetensors import default_dtype
from test_parity64 import assert_state_dicts_equal
from torch import nn

import phalanx as px
from phalanx.testing import engine_of, run_ranks

D, R, V, T = 10, 2, 13, 6  # width, adapter rank, vocabulary, tokens per row
B, STEPS, ACCUM, CLIP = 2, 4, 2, 0.05  # rows per rank and micro-step; CLIP acts on these norms
BUCKET_MB = 0.002  # 262 float64 elements: two units a block, one of them mixed
SEED = 1234
RTOL = 1e-10  # as test_parity64.py: float64 round-off is 1e-14, a semantic error 1e-6 or more
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


class Adapted(nn.Module):
    """A frozen projection with a trainable low-rank pair beside it (LoRA's shape)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(D, D)
        self.base.requires_grad_(False)
        self.down = nn.Linear(D, R, bias=False)
        self.up = nn.Linear(R, D, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = Adapted()
        self.ff = nn.Linear(D, D)
        self.ff.requires_grad_(False)

    def forward(self, x):
        return x + torch.tanh(self.ff(torch.tanh(self.attn(self.norm(x)))))


class LoRANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)  # frozen: a unit of frozen parameters only
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(D, V)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(seed=SEED, dtype=torch.float64):
    torch.manual_seed(seed)
    return LoRANet().to(dtype)


def optimizer_for(model):
    # over every parameter, frozen ones included, as users often build it
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def data(step, rows):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, V, (rows, T), generator=g), torch.randint(0, V, (rows, T), generator=g)


def loss_of(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))


def reference():
    """One process over every rank's rows: the parameters and optimizer state after STEPS."""
    with one_thread():
        model = build()
        opt = optimizer_for(model)
        for step in range(STEPS):
            x, y = data(step, 3 * ACCUM * B)
            loss_of(model, x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        return model.state_dict(), opt.state_dict()


def train(model, opt, steps=STEPS, accum=ACCUM):
    rank, world = px.rank(), px.world_size()
    for step in range(steps):
        x, y = data(step, world * accum * B)
        for a in range(accum):
            c = a * world + rank
            with contextlib.nullcontext() if a == accum - 1 else px.no_sync(model):
                (loss_of(model, x[c * B:(c + 1) * B], y[c * B:(c + 1) * B]) / accum).backward()
        px.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()


def held_bytes(engine) -> tuple[int, int]:
    """(bytes of the shards a zero3 rank holds between uses, bytes of every full buffer
    allocated now)."""
    held = sum(t.numel() * t.element_size() for u in engine.all_units for t in u.held())
    full = sum(u.flat.untyped_storage().nbytes() for u in engine.all_units)
    return held, full


def _copy(sd):
    return {k: v.clone() for k, v in sd.items()}


def _strategies():
    out = {}
    initial = build().state_dict()
    for strategy in STRATEGIES:
        model = build(SEED + px.rank())  # differs per rank: prepare broadcasts rank 0's
        model, opt = px.prepare(model, optimizer_for(model), strategy=strategy,
                                bucket_mb=BUCKET_MB)
        train(model, opt)
        result = {"sd": _copy(model.state_dict()), "optim": px.optimizer_state_dict(opt)}
        engine = engine_of(model)
        if strategy == "zero3":
            result["mixed"] = sum(bool(u.params and u.frozen) for u in engine.units)
            result["frozen only"] = len(engine.frozen_units)
            result["held"], result["full"] = held_bytes(engine)
            result["frozen grads"] = [p.grad for p in px.unwrap(model).parameters()
                                      if not p.requires_grad]
            px.barrier()
            if px.rank() == 0:  # alone, while the others wait
                result["alone"] = px.unwrap(model).state_dict()
            px.barrier()
        px.unwrap(model).load_state_dict(initial)  # through the user's module
        px.barrier()  # every rank has loaded before one reads the others' shards
        result["reloaded"] = model.state_dict()
        with torch.no_grad():
            result["out"] = model(data(99, 2)[0])
        out[strategy] = result
    # prefetch=0: what is gathered at once is what computes (see [Note: freeing a unit in
    # backward]: a block whose frozen weights wait for its backward to be over is freed before
    # the block before it is gathered; a backward under no_sync frees nothing before its end)
    model = build()
    model, opt = px.prepare(model, optimizer_for(model), strategy="zero3", bucket_mb=BUCKET_MB,
                            prefetch=0)
    train(model, opt, accum=1)
    gatherer = engine_of(model).gatherer
    out["peak"] = gatherer.peak_bytes
    out["roots"] = {r.name: sum(u.full_bytes for u in r.units) for r in gatherer.roots}
    return out


def test_every_strategy_trains_a_model_with_frozen_parameters_mixed_into_units():
    results = run_ranks(_strategies, 3, timeout=300)
    want_sd, want_optim = reference()
    initial = build()
    with torch.no_grad():
        want_out = initial(data(99, 2)[0])
    frozen = {k for k, p in initial.named_parameters() if not p.requires_grad}
    model_bytes = sum(t.numel() * t.element_size() for t in initial.state_dict().values())
    for rank, by_strategy in enumerate(results):
        for strategy in STRATEGIES:
            got = by_strategy[strategy]
            context = f"{strategy} rank {rank}"
            assert got["sd"].keys() == want_sd.keys(), context
            for key, want in want_sd.items():
                value = got["sd"][key]
                assert value.dtype == torch.float64, (context, key)
                if key in frozen:  # never stepped, never decayed: exactly the initial value
                    assert torch.equal(value, initial.state_dict()[key]), (context, key)
                err = (value - want).abs().max().item()
                assert err <= RTOL * want.abs().max().item() + 1e-13, (context, key, err)
            assert_state_dicts_equal(got["optim"], want_optim, context)
            for key, value in initial.state_dict().items():  # loaded through px.unwrap
                assert torch.equal(got["reloaded"][key], value), (context, key)
            assert torch.allclose(got["out"], want_out, rtol=0, atol=1e-12), context
        zero3 = by_strategy["zero3"]
        assert zero3["mixed"] == 3 and zero3["frozen only"] == 1  # one per block; the embedding
        assert all(g is None for g in zero3["frozen grads"])
        # between uses: 1/3 of every tensor (each segment padded to a multiple of 3 elements),
        # and no full buffer at all
        assert zero3["full"] == 0
        assert model_bytes / 3 <= zero3["held"] <= model_bytes / 3 + 2 * 8 * 40, zero3["held"]
        block = max(size for name, size in by_strategy["roots"].items() if "blocks" in name)
        assert by_strategy["peak"] <= block + by_strategy["roots"]["head"] < 2 * block
    alone = results[0]["zero3"]["alone"]
    for key, value in results[0]["zero3"]["sd"].items():
        assert torch.equal(alone[key], value), key


# -- checkpoints, export, meta builds and bf16 ---------------------------------------------------
def _prepared(strategy, precision="fp32", seed=SEED, **kwargs):
    model = build(seed)
    return px.prepare(model, optimizer_for(model), strategy=strategy, precision=precision,
                      bucket_mb=BUCKET_MB, **kwargs)


def _files(directory, weights):
    out = {}
    for saved, loaded in (("zero3", "ddp"), ("ddp", "zero3")):
        model, opt = _prepared(saved)
        train(model, opt, steps=2)
        path = os.path.join(directory, f"{saved}-ckpt")
        px.save(path, model=model, optimizer=opt)
        other, other_opt = _prepared(loaded, seed=SEED + 7)  # other values, overwritten
        px.load(path, model=other, optimizer=other_opt)
        out[saved] = (_copy(model.state_dict()), px.optimizer_state_dict(opt),
                      _copy(other.state_dict()),
                      px.optimizer_state_dict(other_opt))
        if saved == "zero3":
            px.export(os.path.join(directory, "export.safetensors"), model)
            out["export"] = _copy(model.state_dict())
    with torch.device("meta"):
        meta = LoRANet().to(torch.float64)
    model, _ = px.prepare(meta, optimizer_for(meta), strategy="zero3", bucket_mb=BUCKET_MB,
                          init=px.from_safetensors(weights))
    out["pretrained"] = model.state_dict()
    torch.manual_seed(SEED)
    with torch.device("meta"), default_dtype(torch.float64):  # drawn in float64, as below
        meta = LoRANet()
    model, _ = px.prepare(meta, optimizer_for(meta), strategy="zero3", bucket_mb=BUCKET_MB)
    out["drawn"] = model.state_dict()
    out["drawn shards"] = [u.frozen_shard.clone() for u in engine_of(model).all_units
                           if u.frozen]
    for strategy in ("ddp", "zero3"):  # bf16: the frozen parameters held in bf16
        model, opt = _prepared(strategy, "bf16")
        train(model, opt, steps=3)
        out[f"bf16 {strategy}"] = _copy(model.state_dict())
        out[f"bf16 {strategy} dtypes"] = {u.frozen_shard.dtype for u in engine_of(model).all_units
                                          if u.frozen}
    return out


def test_checkpoints_export_and_meta_builds_hold_frozen_shards_whole(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(SEED + 3)
    pretrained = {k: v.contiguous() for k, v in LoRANet().to(torch.float64).state_dict().items()}
    weights = str(tmp_path / "model.safetensors")
    save_file(pretrained, weights)
    results = run_ranks(_files, 2, args=(str(tmp_path), weights), timeout=300)
    initial = build().state_dict()
    frozen = {k for k, p in build().named_parameters() if not p.requires_grad}
    torch.manual_seed(SEED)
    with default_dtype(torch.float64):
        drawn = LoRANet().state_dict()
    for rank, got in enumerate(results):
        for saved in ("zero3", "ddp"):  # a checkpoint of one loads under the other, exactly
            sd, optim, loaded_sd, loaded_optim = got[saved]
            for key, value in sd.items():
                assert torch.equal(loaded_sd[key], value), (saved, rank, key)
            assert_state_dicts_equal(loaded_optim, optim, f"{saved} rank {rank}")
        exported = load_file(str(tmp_path / "export.safetensors"))
        for key, value in got["export"].items():
            assert torch.equal(exported[key], value), key
        for key, value in pretrained.items():
            assert torch.equal(got["pretrained"][key], value), key
        for key, value in drawn.items():  # a meta build draws what a full build draws
            assert torch.equal(got["drawn"][key], value), key
        assert got["bf16 zero3 dtypes"] == {torch.bfloat16}
        for key, value in got["bf16 ddp"].items():
            other = got["bf16 zero3"][key]
            assert other.dtype == torch.float64, key
            if key in frozen:  # held in bf16, given back widened
                assert torch.equal(other, initial[key].to(torch.bfloat16).double()), key
                assert torch.equal(value, other), key
            else:  # the same bf16 training, reduced on other paths
                err = (other - value).abs().max().item()
                assert err <= 2e-2 * value.abs().max().item(), (key, err)
    # the two ranks hold different halves of the frozen shards
    assert not torch.equal(results[0]["drawn shards"][0], results[1]["drawn shards"][0])
