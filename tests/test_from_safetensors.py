"""`px.prepare(..., init=px.from_safetensors(path))`: pretrained weights read into each rank's
shards, against the same files loaded into a full model in one process.

A model of our own (tied embeddings left out of the files as Hugging Face leaves them, a
non-persistent buffer its own reset_parameters computes, a persistent buffer, a frozen layer,
sizes that put shard boundaries inside rows) written with `safetensors.torch.save_file`, as one
file and as an index with shards split mid-model; and a small Hugging Face Llama written with
`save_pretrained` (test_from_safetensors_hf.py). Values are compared exactly; one training
step afterwards in float64 against one process with the whole batch.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

import phalanx as px
from phalanx.model import prepare as prepare_module
from phalanx.testing import engine_of, run_ranks

VOCAB, D, BATCH = 13, 12, 6  # BATCH: whole over 1, 2 and 3 ranks


class Rotary(nn.Module):
    """A non-persistent buffer, as a rotary embedding's inv_freq: in no file, computed."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, self.dim, 2) / self.dim))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 20)
        self.down = nn.Linear(20, d)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.rope = Rotary(D)
        self.blocks = nn.ModuleList(Block(D) for _ in range(3))
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.ones(D))  # persistent: in the files
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens) * torch.cos(self.rope.inv_freq).repeat(2) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(self.frozen(h))


@contextlib.contextmanager
def default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _trained_weights(dtype) -> dict:
    """A Tiny's state_dict as Hugging Face writes one: the tied head left out."""
    with default_dtype(dtype):
        torch.manual_seed(0)
        model = Tiny()
        with torch.no_grad():
            model.scale.uniform_(0.5, 1.5)
    return {k: v.clone() for k, v in model.state_dict().items() if k != "head.weight"}


def write(directory, tensors: dict, shards: int = 1) -> str:
    """`tensors` as `model.safetensors`, or split in order over `shards` files with an index."""
    os.makedirs(directory, exist_ok=True)
    if shards == 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"), {"format": "pt"})
        return str(directory)
    keys, weight_map = list(tensors), {}
    size = -(-len(keys) // shards)
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i * size:(i + 1) * size]}
        save_file(part, os.path.join(directory, name), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(directory)


def tokens(world, rank):
    all_tokens = torch.arange(BATCH * 7).view(BATCH, 7) * 5 % VOCAB
    per = BATCH // world
    return all_tokens[rank * per:(rank + 1) * per]


def train_step(model, opt, batch):
    logits = model(batch[:, :-1])
    F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def _load(case):
    """On every rank: prepare a Tiny from the files as `case` says, train one step."""
    directory, strategy, precision, dtype, meta = case
    broadcasts = []  # prepare's broadcast of rank 0's model, which the files make needless
    broadcast = prepare_module.broadcast_from_rank0
    prepare_module.broadcast_from_rank0 = lambda *a: (broadcasts.append(a), broadcast(*a))
    with default_dtype(dtype):
        torch.manual_seed(7 + px.rank())  # a full build differs per rank: the files must win
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        weights = px.from_safetensors(directory)
        model, opt = px.prepare(model, opt, strategy=strategy, precision=precision,
                                init=weights)
        loaded = {k: v.clone() for k, v in model.state_dict().items()}
        inner = px.unwrap(model)
        out = {"loaded": loaded, "inv_freq": inner.rope.inv_freq.clone(),
               "tied": inner.head.weight is inner.embed.weight, "read": weights.read_bytes,
               "pieces": sum(len(p) for p in engine_of(model).master_pieces().values()),
               "broadcasts": len(broadcasts),
               "masters": {name: [(q.start, q.master.detach().reshape(-1).clone())
                                  for q in engine_of(model).master_pieces().get(id(p), [])]
                           for name, p in inner.named_parameters()}}
        prepare_module.broadcast_from_rank0 = broadcast
        if precision == "fp32":  # (Tiny's forward mixes dtypes under bf16 compute)
            train_step(model, opt, tokens(px.world_size(), px.rank()))
            out["trained"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _cases(cases):
    return [_load(case) for case in cases]


def reference(tensors: dict, dtype, world):
    """One process, no phalanx: a full Tiny, load_state_dict, one step with the whole batch."""
    with default_dtype(dtype):
        model = Tiny()
        model.load_state_dict(tensors, strict=False)
        loaded = {k: v.clone() for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt, torch.cat([tokens(world, r) for r in range(world)]))
        return loaded, model.rope.inv_freq.clone(), model.state_dict()


def check_against_reference(result, tensors, dtype, world):
    loaded, inv_freq, trained = reference(tensors, dtype, world)
    assert result["tied"]
    assert result["loaded"].keys() == loaded.keys()
    for key in loaded:
        assert torch.equal(result["loaded"][key], loaded[key]), key
    assert torch.equal(result["inv_freq"], inv_freq)
    assert result["broadcasts"] == 0  # every rank read the same values
    for key in trained:
        assert torch.allclose(result["trained"][key], trained[key], rtol=0, atol=1e-12), key
    assert not torch.equal(trained["embed.weight"], loaded["embed.weight"])  # it trained


def test_two_ranks_every_strategy_one_file_and_shards_equal_one_process(tmp_path):
    """zero3 (from a meta build, and from a full one), ddp, zero2 and zero1; one file and an
    index of three files; float64, so one step matches one process to round-off."""
    tensors = _trained_weights(torch.float64)
    single = write(tmp_path / "single", tensors)
    split = write(tmp_path / "split", tensors, shards=3)
    cases = [(single, "zero3", "fp32", torch.float64, True),
             (split, "zero3", "fp32", torch.float64, True),
             (split, "zero3", "fp32", torch.float64, False),
             (split, "ddp", "fp32", torch.float64, True),
             (single, "zero2", "fp32", torch.float64, True),
             (single, "zero1", "fp32", torch.float64, True)]
    by_rank = run_ranks(_cases, 2, args=(cases,), timeout=240)
    file_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    whole = sum(t.numel() * t.element_size() for k, t in tensors.items()
                if k.startswith("frozen.") or k == "scale")  # every rank holds these whole
    largest_row = max(t[0].numel() * t.element_size() for t in tensors.values() if t.dim() > 1)
    for results in by_rank:
        for _case, result in zip(cases, results):
            check_against_reference(result, tensors, torch.float64, 2)
        zero3_meta, _, zero3_full, ddp, zero2, _ = results
        # zero3 reads about half the trainable tensors per rank, never the whole file
        bound = (file_bytes - whole) / 2 + whole + 2 * largest_row * zero3_meta["pieces"]
        assert zero3_meta["read"] <= bound < file_bytes, (zero3_meta["read"], bound)
        assert ddp["read"] == zero2["read"] == zero3_full["read"] == file_bytes
    assert sum(r[0]["read"] for r in by_rank) >= file_bytes


def test_three_ranks_zero3_from_shards_equals_one_process(tmp_path):
    tensors = _trained_weights(torch.float64)
    split = write(tmp_path / "split", tensors, shards=2)
    for (result,) in run_ranks(_cases, 3, args=([(split, "zero3", "fp32", torch.float64,
                                                   True)],), timeout=240):
        check_against_reference(result, tensors, torch.float64, 3)


def test_a_bf16_file_gives_fp32_masters_holding_its_values_under_bf16_compute(tmp_path):
    """The masters (and state_dict) are the file's bf16 (fp16) values, exactly, in fp32:
    nothing rounded them through another dtype on the way."""
    files = {dtype: {k: v.to(dtype) for k, v in _trained_weights(torch.float32).items()}
             for dtype in (torch.bfloat16, torch.float16)}
    bf16 = write(tmp_path / "bf16", files[torch.bfloat16], shards=2)
    cases = [(bf16, strategy, "bf16", torch.float32, True) for strategy in ("zero3", "ddp")]
    cases.append((write(tmp_path / "fp16", files[torch.float16]), "zero3", "fp16", torch.float32,
                  True))
    for results in run_ranks(_cases, 2, args=(cases,), timeout=240):
        for result, (_, _, precision, _, _) in zip(results, cases):
            tensors = files[torch.bfloat16 if precision == "bf16" else torch.float16]
            loaded = result["loaded"]
            assert result["tied"] and torch.equal(loaded["head.weight"], loaded["embed.weight"])
            for key, value in tensors.items():
                assert loaded[key].dtype == torch.float32, key
                assert torch.equal(loaded[key], value.float()), key
            held = 0
            for name, pieces in result["masters"].items():
                for start, master in pieces:
                    assert master.dtype == torch.float32, name
                    value = tensors[name].float().reshape(-1)[start:start + master.numel()]
                    assert torch.equal(master, value), name
                    held += master.numel()
            assert held > 0


class Bare(nn.Module):
    """A non-persistent buffer that nothing but the constructor computes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(2.0), persistent=False)


def _refusals(directories, good):
    """Each bad set of files refused on every rank, the model left on meta; then a good one
    loads in the same group (no rank was left behind in a collective)."""
    messages = {}
    for name, directory in directories.items():
        if isinstance(directory, list):  # a path of each rank's own
            directory = directory[px.rank()]
        with torch.device("meta"):
            model = Bare() if name == "buffer" else Tiny()
        with pytest.raises(ValueError) as info:
            px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="zero3",
                       init=px.from_safetensors(directory))
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()]), name
        messages[name] = str(info.value)
    with torch.device("meta"):
        model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = px.prepare(model, opt, strategy="zero3", init=px.from_safetensors(good))
    return messages, model.state_dict()["embed.weight"]


def test_missing_extra_and_misshaped_keys_are_refused_by_name_on_every_rank(tmp_path):
    tensors = _trained_weights(torch.float32)
    good = write(tmp_path / "good", tensors)
    missing = {k: v for k, v in tensors.items() if k not in ("embed.weight",
                                                               "blocks.1.up.weight")}
    directories = {
        "missing": write(tmp_path / "missing", missing, shards=2),
        "extra": write(tmp_path / "extra", {**tensors, "blocks.3.up.weight": torch.ones(20, D)}),
        "shape": write(tmp_path / "shape", {**tensors, "embed.weight": torch.ones(14, D)}),
        "one rank": [good, str(tmp_path / "nowhere")],
        "buffer": write(tmp_path / "bare", {"lin.weight": torch.ones(4, 4),
                                            "lin.bias": torch.ones(4)}),
    }
    for messages, embed in run_ranks(_refusals, 2, args=(directories, good), timeout=240):
        assert "does not fit the model, so nothing was loaded: 2 keys missing from the files: " \
               "'embed.weight' (tied: or 'head.weight'), 'blocks.1.up.weight'. The files' " \
               "names must be the model's state_dict() keys" in messages["missing"]
        assert "1 key in the files but not in the model: 'blocks.3.up.weight'" \
               in messages["extra"]
        assert "1 key of another shape: 'embed.weight' is [14, 12] in the files but [13, 12] " \
               "in the model" in messages["shape"]
        assert messages["one rank"].startswith(f"on rank 1: px.from_safetensors("
                                               f"{str(tmp_path / 'nowhere')!r}) cannot be read")
        assert "the buffer 'inv_freq' is not saved with the model (non-persistent) and is on " \
               "the meta device, and Bare has no reset_parameters() to compute it" \
               in messages["buffer"]
        assert torch.equal(embed, tensors["embed.weight"])


@pytest.mark.one_process
def test_in_one_process_it_is_an_init_fn_that_loads_a_full_model(tmp_path):
    tensors = _trained_weights(torch.float32)
    weights = px.from_safetensors(write(tmp_path / "split", tensors, shards=2))
    model = Tiny()
    weights(model)
    assert model.head.weight is model.embed.weight
    for key, value in tensors.items():
        assert torch.equal(model.state_dict()[key], value), key
    assert weights.read_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    with pytest.raises(ValueError, match="1 key of another shape: 'scale' is \\[12\\] in the "
                                         "files but \\[5\\] in the model"):
        model.scale = torch.ones(5)
        weights(model)

