"""`px.export` of a LoRA model (checkpoint/lora.py): the merged model under the base model's
names (`merge_lora=True`), or the adapter alone as PEFT saves it (`adapter=True`).

A Llama-shaped model (tests/test_from_safetensors_peft.py's CausalLM, its head tied to the
embedding) wrapped as PEFT's `get_peft_model` wraps one, needing no peft: the base under
`base_model.model.`, q_proj and v_proj LoRA layers holding `base_layer` beside `lora_A.default`
and `lora_B.default` and `scaling["default"] = lora_alpha / r = 6 / 4` (PEFT's LoraLayer), a
dropout per adapter, a second adapter "other" on v_proj that is not active (its B nonzero), the
final norm in `modules_to_save`, and a `peft_config`. Trained three AdamW steps at 2 ranks
under ddp, zero1, zero2 and zero3 in float64 and exported, against the same model trained in
one process and merged as `merge_and_unload()` merges (W + (B @ A) * scaling, each LoRA layer
replaced by its base layer, the norm by its trained copy):

- merge_lora=True: exactly the plain CausalLM's names, every value equal to one process's merge
  to 1e-12 (B nonzero after training, "other" left out); the sharded layout and a bf16 export
  equal the one file, the latter cast;
- adapter="default": `adapter_model.safetensors` under PEFT's keys (no adapter name, the norm's
  copy under the wrapper's name), its values the trained adapter's, and `adapter_config.json`;
- what cannot be merged is refused by name, on both ranks (no hang), nothing written;
- rank 0's peak memory rises during a merged export by less than one layer plus 10% of the
  fp32 model, under ddp and zero3;
- `phalanx export --adapter` writes the same adapter from a checkpoint, and `--merge-lora` is
  refused there, naming px.export;
- with peft and transformers installed (CI has neither): PEFT's LoRA Llama trained under zero3,
  its merged export loaded by `from_pretrained` and its adapter by `PeftModel.from_pretrained`
  give what `merge_and_unload()` and the trained model give.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.nn as nn
from resident import peak_rise
from safetensors.torch import load_file
from test_from_safetensors import default_dtype
from test_from_safetensors_peft import SMALL, CausalLM, loss_of, tokens

import phalanx as px
from phalanx.checkpoint.api import export_checkpoint
from phalanx.checkpoint.export import INDEX
from phalanx.testing import run_ranks

STEPS, R, ALPHA = 3, 4, 6
SCALING = ALPHA / R  # 1.5
SHARD = 2000  # bytes: the float64 model over several files
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


# -- PEFT's LoRA wrapping, as get_peft_model makes it --------------------------------------------
class LoraLinear(nn.Module):
    """peft.tuners.lora.Linear's shape: the wrapped layer as `base_layer`, per adapter a dropout,
    A (drawn as nn.Linear draws) and B (zero), the scaling lora_alpha / r in `scaling[name]`,
    and the adapters in use in `active_adapters`."""

    def __init__(self, base_layer, adapters=("default",), r=R, alpha=ALPHA, bias=False):
        super().__init__()
        self.base_layer = base_layer
        d_in, d_out = base_layer.in_features, base_layer.out_features
        self.lora_dropout = nn.ModuleDict({a: nn.Dropout(0.0) for a in adapters})
        self.lora_A = nn.ModuleDict({a: nn.Linear(d_in, r, bias=False) for a in adapters})
        self.lora_B = nn.ModuleDict({a: nn.Linear(r, d_out, bias=bias) for a in adapters})
        self.scaling = {a: alpha / r for a in adapters}
        self.active_adapters = ["default"]
        for a in adapters:
            nn.init.kaiming_uniform_(self.lora_A[a].weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[a].weight)

    def forward(self, x):
        out = self.base_layer(x)
        for a in self.active_adapters:
            out = out + self.lora_B[a](self.lora_A[a](self.lora_dropout[a](x))) * self.scaling[a]
        return out


class ModulesToSave(nn.Module):
    """PEFT's ModulesToSaveWrapper: the original module, and a trained copy per adapter."""

    def __init__(self, module):
        super().__init__()
        self.original_module = module.requires_grad_(False)
        self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(module)})
        self.modules_to_save.requires_grad_(True)

    def forward(self, x):
        return self.modules_to_save["default"](x)


class LoraModel(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        model.requires_grad_(False)
        for name, module in list(model.named_modules()):
            last = name.rsplit(".", 1)[-1]
            if last in ("q_proj", "v_proj"):
                adapters = ("default", "other") if last == "v_proj" else ("default",)
                model.set_submodule(name, LoraLinear(module, adapters))
        model.model.norm = ModulesToSave(model.model.norm)
        for module in model.modules():  # "other" is not active: frozen, as PEFT leaves it
            if isinstance(module, LoraLinear) and "other" in module.lora_A:
                module.lora_A["other"].requires_grad_(False)
                module.lora_B["other"].requires_grad_(False)
                nn.init.normal_(module.lora_B["other"].weight)


class PeftModel(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.base_model = LoraModel(model)
        self.peft_config = {
            "default": types.SimpleNamespace(r=R, lora_alpha=ALPHA, task_type="CAUSAL_LM"),
            "other": types.SimpleNamespace(r=R, lora_alpha=ALPHA, task_type="CAUSAL_LM")}

    def forward(self, tokens):
        return self.base_model.model(tokens)


def lora_model() -> PeftModel:
    torch.manual_seed(0)
    base = CausalLM(**SMALL)
    base.name_or_path = "tiny/llama"  # as from_pretrained records it
    torch.manual_seed(1234)
    return PeftModel(base)


def train(model, strategy=None):
    """STEPS AdamW steps: prepared under `strategy`, each rank its share of the batch; or in
    one process (no strategy), the whole batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world, rank = 1, 0
    if strategy is not None:
        model, opt = px.prepare(model, opt, strategy=strategy)
        world, rank = px.world_size(), px.rank()
    for step in range(STEPS):
        loss_of(model, tokens(step, world, rank)).backward()
        opt.step()
        opt.zero_grad()
    return model


def merge_and_unload(model: PeftModel) -> dict:
    """What PEFT's merge_and_unload() gives, by hand: each LoRA layer replaced by its base
    layer, whose weight gains (B @ A) * scaling of the active adapter, and a module in
    modules_to_save replaced by its copy; the plain model's state_dict."""
    plain = copy.deepcopy(model).base_model.model
    for name, module in list(plain.named_modules()):
        if isinstance(module, LoraLinear):
            (a,) = module.active_adapters
            base = module.base_layer
            with torch.no_grad():
                base.weight += (module.lora_B[a].weight @ module.lora_A[a].weight) * \
                    module.scaling[a]
            plain.set_submodule(name, base)
        elif isinstance(module, ModulesToSave):
            plain.set_submodule(name, module.modules_to_save["default"])
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}


def peft_keys(model: PeftModel) -> dict[str, str]:
    """PEFT's adapter file's keys for "default" -> the model's keys, written out by hand."""
    out = {}
    for i in range(SMALL["layers"]):
        for proj in ("q_proj", "v_proj"):
            for part in ("lora_A", "lora_B"):
                at = f"base_model.model.model.layers.{i}.self_attn.{proj}.{part}"
                out[f"{at}.weight"] = f"{at}.default.weight"
    out["base_model.model.model.norm.weight"] = \
        "base_model.model.model.norm.modules_to_save.default.weight"
    return out


# -- 2 ranks against one process ----------------------------------------------------------------
def _train_and_export(path, strategies):
    held = {}
    for strategy in strategies:
        with default_dtype(torch.float64):
            model = train(lora_model(), strategy)
            at = os.path.join(path, strategy)
            px.export(at + ".safetensors", model, merge_lora=True)
            px.export(at + ".sharded", model, merge_lora=True, max_shard_size=SHARD)
            px.export(at + ".bf16", model, merge_lora=True, dtype=torch.bfloat16)
            px.export(at + ".adapter", model, adapter="default")
            state = model.state_dict()
            held[strategy] = {k: v.clone() for k, v in state.items()} if px.rank() == 0 else None
    return held


def _read_sharded(directory):
    with open(os.path.join(directory, INDEX)) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(os.listdir(directory)) == sorted(files + [INDEX])
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(directory, name)))
    assert set(tensors) == set(index["weight_map"])
    return tensors, index


def test_two_ranks_export_the_merged_model_and_the_adapter_as_one_process_merges(tmp_path):
    with default_dtype(torch.float64):
        reference = train(lora_model())
        want = merge_and_unload(reference)
        untrained = lora_model().state_dict()
        plain_names = list(CausalLM(**SMALL).state_dict())
    state = reference.state_dict()
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    assert torch.any(state[f"{q}.lora_B.default.weight"])  # B moved off zero: a merge to check
    assert not torch.equal(want["model.norm.weight"], untrained[
        "base_model.model.model.norm.original_module.weight"])  # the trained copy
    assert list(want) == plain_names and "lm_head.weight" in want  # the tied head, both names
    results = run_ranks(_train_and_export, 2, args=(str(tmp_path), STRATEGIES), timeout=300)
    for strategy in STRATEGIES:
        at = str(tmp_path / strategy)
        one = load_file(at + ".safetensors")
        assert list(one) == plain_names, strategy  # the base model's names, in its order
        for name, value in want.items():
            assert one[name].dtype == torch.float64
            assert torch.allclose(one[name], value, rtol=0, atol=1e-12), (strategy, name)
        held = results[0][strategy]
        for proj in ("q_proj", "v_proj"):  # from what the ranks hold: W + (B @ A) * 1.5
            lora = f"base_model.model.model.layers.0.self_attn.{proj}"
            merged = held[f"{lora}.base_layer.weight"] + (
                held[f"{lora}.lora_B.default.weight"] @ held[f"{lora}.lora_A.default.weight"]
            ) * SCALING
            assert torch.equal(one[f"model.layers.0.self_attn.{proj}.weight"], merged), proj
        sharded, index = _read_sharded(at + ".sharded")
        assert list(index["weight_map"]) == plain_names
        assert all(torch.equal(sharded[k], v) for k, v in one.items()), strategy
        cast = load_file(at + ".bf16")
        assert all(torch.equal(cast[k], v.to(torch.bfloat16)) for k, v in one.items())

        adapter = load_file(os.path.join(at + ".adapter", "adapter_model.safetensors"))
        keys = peft_keys(reference)
        assert set(adapter) == set(keys), strategy
        for out, key in keys.items():
            assert torch.equal(adapter[out], held[key]), (strategy, out)
            assert torch.allclose(adapter[out], state[key], rtol=0, atol=1e-12), (strategy, out)
        with open(os.path.join(at + ".adapter", "adapter_config.json")) as f:
            config = json.load(f)
        assert config == {"r": R, "lora_alpha": ALPHA, "task_type": "CAUSAL_LM",
                          "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA",
                          "base_model_name_or_path": "tiny/llama", "inference_mode": True}


@pytest.mark.one_process
@pytest.mark.parametrize("rows", [1, 7, 10, 2**16])
def test_a_piece_is_merged_in_runs_of_rows_that_cover_it_exactly(monkeypatch, rows):
    """`merged` on pieces that start and end inside a row, in runs of `rows` elements (fewer
    than a row, several rows, the whole piece): the pieces' runs together are W + (B @ A) * s."""
    from phalanx.checkpoint import lora

    monkeypatch.setattr(lora, "ROWS", rows)
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((6, 5), (3, 5), (6, 3)))
    want = (w + (b @ a) * 1.5).reshape(-1)
    merge = lora.Merge("layer", "a", "b", 1.5, torch.float64)
    got = torch.full_like(want, float("nan"))
    for start, end in ((0, 7), (7, 8), (8, 23), (23, 30)):
        at = start
        for first, values in lora.merged(start, w.reshape(-1)[start:end], 5, a, b, merge):
            assert first == at and values.numel() <= max(rows // 5, 1) * 5  # bounded, in order
            got[at:at + values.numel()] = values
            at += values.numel()
        assert at == end
    assert torch.equal(got, want)


# -- refusals -----------------------------------------------------------------------------------
def _unmergeable(kind: str) -> PeftModel:
    with default_dtype(torch.float64):
        model = lora_model()
    decoder = model.base_model.model.model
    v = decoder.layers[0].self_attn.v_proj
    if kind == "several":
        for layer in decoder.layers:
            layer.self_attn.v_proj.active_adapters = ["default", "other"]
    elif kind == "embedding":
        embed = decoder.embed_tokens
        decoder.embed_tokens = LoraLinear(nn.Linear(2, 2))
        decoder.embed_tokens.base_layer = embed
    elif kind == "lora_bias":
        v.lora_B["default"] = nn.Linear(R, v.base_layer.out_features)
    elif kind == "dora":
        v.lora_magnitude_vector = nn.ParameterDict({"default": nn.Parameter(torch.ones(3))})
    elif kind == "scaling":
        v.scaling = {"other": 1.0}
    elif kind == "fan_in_fan_out":
        v.fan_in_fan_out = True
    elif kind == "merged":
        v.merged_adapters = ["default"]
    elif kind == "conv":
        v.lora_A["default"] = nn.Conv1d(SMALL["d"], R, 1, bias=False)
    elif kind == "prompt":
        model.prompt_encoder = nn.ModuleDict({"default": nn.Embedding(3, SMALL["d"])})
    return model


V = "'base_model.model.model.layers.0.self_attn.v_proj' (adapter 'default')"
REFUSALS = {
    "several": "2 LoRA layers have several active adapters "
               "('base_model.model.model.layers.0.self_attn.v_proj': 'default', 'other'); "
               "merge_lora=True merges one: make one active (peft's model.set_adapter('default'))",
    "embedding": "LoRA on Embedding, where merge_lora=True merges LoRA on nn.Linear only: "
                 "'base_model.model.model.embed_tokens' (adapter 'default')",
    "lora_bias": f"a bias in the adapter (lora_bias=True), which this merge does not add: {V}",
    "dora": f"a LoRA variant (DoRA), whose merge is not W + (B @ A) * scaling: {V}",
    "scaling": "no scaling for the adapter (PEFT's LoraLayer holds lora_alpha / r in "
               f"scaling[<adapter>], or a number in scaling): {V}",
    "fan_in_fan_out": f"fan_in_fan_out=True (a transposed weight): {V}",
    "merged": "adapters already merged into the base weight: unmerge them first (peft's "
              f"model.unmerge_adapter()): {V}",
    "conv": "lora_A Conv1d and lora_B Linear, not the two nn.Linear of LoRA on nn.Linear: "
            f"{V}",
    "prompt": "1 of the adapters' tensors outside any LoRA layer, which no merge puts in the "
              "base model: 'prompt_encoder.default.weight'",
}


@pytest.mark.one_process
@pytest.mark.parametrize("kind", list(REFUSALS))
def test_what_cannot_be_merged_is_refused_by_name_before_anything_is_written(tmp_path, kind):
    with pytest.raises(ValueError) as info:
        px.export(str(tmp_path / "m.safetensors"), _unmergeable(kind), merge_lora=True)
    message = str(info.value)
    assert message.startswith("px.export(path, model): merge_lora=True cannot merge this model")
    assert REFUSALS[kind] in message, message
    assert message.endswith("Export the adapter alone (adapter=True) or the model as it is "
                            "(merge_lora=False)")
    assert os.listdir(tmp_path) == []


@pytest.mark.one_process
@pytest.mark.parametrize("kwargs,error,says", [
    ({"merge_lora": True, "adapter": True}, ValueError, "choose one"),
    ({"adapter": True, "max_shard_size": "1GB"}, ValueError, "takes no max_shard_size"),
    ({"adapter": True, "path": "a.safetensors"}, ValueError, "name a directory"),
    ({"adapter": True}, ValueError, "adapter=True exports the model's one adapter, and it has "
                                    "2: 'default', 'other'; name one, e.g. adapter='default'"),
    ({"adapter": "nope"}, ValueError, "adapter='nope' is not an adapter of this model; it has "
                                      "'default', 'other'"),
    ({"adapter": 1}, TypeError, "adapter= takes True"),
    ({"merge_lora": "yes"}, TypeError, "merge_lora= takes True or False"),
])
def test_bad_adapter_arguments_are_refused(tmp_path, kwargs, error, says):
    kwargs = dict(kwargs)
    path = str(tmp_path / kwargs.pop("path", "out"))
    with pytest.raises(error, match=re.escape(says)):
        px.export(path, lora_model(), **kwargs)
    assert os.listdir(tmp_path) == []


@pytest.mark.one_process
@pytest.mark.parametrize("config,says", [
    ({"peft_type": "IA3"}, "adapter=True writes LoRA adapters, and this one is IA3"),
    ({"bias": "all"}, "adapter=True writes LoRA adapters with bias='none', and this one has "
                      "bias='all'"),
])
def test_an_adapter_peft_would_save_otherwise_is_refused(tmp_path, config, says):
    model = lora_model()
    model.peft_config = {"default": {"r": R, "lora_alpha": ALPHA, **config}}
    with pytest.raises(ValueError, match=re.escape(says)):
        px.export(str(tmp_path / "adapter"), model, adapter="default")
    assert os.listdir(tmp_path) == []


@pytest.mark.one_process
def test_a_model_of_one_adapter_exports_it_with_adapter_true_and_a_filled_in_config(tmp_path):
    """With one adapter adapter=True takes it; a peft_config that says only r and lora_alpha
    is filled in with what the model shows, and the base model's class is named (PEFT's
    auto_mapping) where it gives no task_type; the inactive adapter's tensors are left out."""
    model = lora_model()
    model.peft_config = {"default": {"r": R, "lora_alpha": ALPHA}}
    for layer in model.base_model.model.model.layers:
        v = layer.self_attn.v_proj
        for part in (v.lora_A, v.lora_B, v.lora_dropout):
            del part["other"]
        v.scaling.pop("other")
    px.export(str(tmp_path / "adapter"), model, adapter=True)
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json",
                                                        "adapter_model.safetensors"]
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    state = model.state_dict()
    assert {k: state[v] for k, v in peft_keys(model).items()}.keys() == got.keys()
    assert all(torch.equal(got[k], state[v]) for k, v in peft_keys(model).items())
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    assert config == {"r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"],
                      "peft_type": "LORA", "base_model_name_or_path": "tiny/llama",
                      "inference_mode": True,
                      "auto_mapping": {"base_model_class": "CausalLM",
                                       "parent_library": "test_from_safetensors_peft"}}


def _refused_on_every_rank(path):
    model = _unmergeable("several")
    model, _ = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="zero3")
    with pytest.raises(ValueError, match="several active adapters"):
        px.export(os.path.join(path, "m.safetensors"), model, merge_lora=True)
    px.export(os.path.join(path, "m.safetensors"), model)  # the ranks are still in step
    return True


def test_a_refusal_is_raised_on_every_rank_before_any_collective(tmp_path):
    assert run_ranks(_refused_on_every_rank, 2, args=(str(tmp_path),), timeout=120) == [True] * 2
    assert os.listdir(tmp_path) == ["m.safetensors"]


# -- the command line ---------------------------------------------------------------------------
@pytest.mark.slow  # a checkpoint written by 2 ranks, then two commands (PHALANX_SLOW=1)
def test_the_command_line_exports_the_adapter_and_refuses_to_merge(tmp_path):
    model = lora_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    px.save(str(tmp_path / "ckpt"), model=model)
    command = [sys.executable, "-m", "phalanx", "export", str(tmp_path / "ckpt")]
    done = subprocess.run(command + [str(tmp_path / "adapter"), "--adapter", "default"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "no adapter_config.json" in done.stdout
    assert os.listdir(tmp_path / "adapter") == ["adapter_model.safetensors"]
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    state = model.state_dict()
    assert got.keys() == peft_keys(model).keys()
    assert all(torch.equal(got[k], state[v]) for k, v in peft_keys(model).items())
    with pytest.raises(ValueError, match=re.escape(
            "phalanx export CKPT OUT: --adapter exports the model's one adapter, and it has 2: "
            "'default', 'other'; name one, e.g. --adapter default")):
        export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "again"), adapter=True)
    assert not os.path.exists(tmp_path / "again")
    done = subprocess.run(command + [str(tmp_path / "merged.safetensors"), "--merge-lora"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "a checkpoint does not record it (this one holds 12 LoRA tensors); export the " \
           "merged model from the running model instead: px.export(path, model, " \
           "merge_lora=True)" in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / "merged.safetensors")


# -- memory -------------------------------------------------------------------------------------
LAYERS, WIDTH = 24, 1024  # 24 layers of 4 MiB: a 100 MB fp32 model


def _peak_rise(path, strategy):
    torch.manual_seed(0)
    model = nn.Sequential(*[LoraLinear(nn.Linear(WIDTH, WIDTH), r=8) for _ in range(LAYERS)])
    for layer in model:
        layer.base_layer.requires_grad_(False)
        nn.init.normal_(layer.lora_B["default"].weight)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model = px.prepare(model, opt, strategy=strategy)[0]
    px.export(path + ".warm", model, merge_lora=True, max_shard_size="1GB")  # first use
    return [peak_rise(lambda i=i, kw=kw: px.export(
        path + str(i) + ("" if kw else ".safetensors"), model, merge_lora=True, **kw))
        for i, kw in enumerate(({}, {"max_shard_size": "20MB"}))]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's VmHWM reset")
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_rank_0s_peak_memory_in_a_merged_export_rises_by_less_than_a_unit_plus_a_tenth(
        tmp_path, strategy):
    rises = run_ranks(_peak_rise, 2, args=(str(tmp_path / "m"), strategy), timeout=300)[0]
    unit = (WIDTH * WIDTH + WIDTH) * 4  # one layer, fp32
    bound = unit + 0.1 * LAYERS * unit
    assert max(rises) < bound, (rises, bound)
    print(f"{strategy}: rank 0's peak rise {[r / 1e6 for r in rises]} MB, bound {bound / 1e6} MB")


# -- PEFT's own LoRA Llama ----------------------------------------------------------------------
def _peft_train_and_export(config, lora_config, path):
    from peft import get_peft_model
    from test_from_safetensors_hf import llama_loss, llama_tokens
    from transformers import LlamaForCausalLM

    with default_dtype(torch.float64):
        torch.manual_seed(0)
        base = LlamaForCausalLM(config)
        torch.manual_seed(1234)
        model = get_peft_model(base, lora_config)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, opt = px.prepare(model, opt, strategy="zero3")
        for _ in range(2):
            llama_loss(model, llama_tokens(px.world_size(), px.rank())).backward()
            opt.step()
            opt.zero_grad()
        if px.is_main():
            config.save_pretrained(os.path.join(path, "merged"))
        px.export(os.path.join(path, "merged"), model, merge_lora=True, max_shard_size=20000)
        px.export(os.path.join(path, "adapter"), model, adapter=True)
        return {k: v.clone() for k, v in model.state_dict().items()}


def test_peft_lora_llama_exports_what_from_pretrained_and_peft_load(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("peft", reason="peft is not installed")
    from peft import LoraConfig, PeftModel, get_peft_model
    from test_from_safetensors_hf import llama_tokens
    from test_zero3_peft import reference_step
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32, tie_word_embeddings=False)
    lora_config = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                             modules_to_save=["lm_head"])
    trained = run_ranks(_peft_train_and_export, 2, args=(config, lora_config, str(tmp_path)),
                        timeout=300)[0]
    with default_dtype(torch.float64):
        torch.manual_seed(0)
        base = LlamaForCausalLM(config)
        torch.manual_seed(1234)
        reference = get_peft_model(base, lora_config)
        opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(2):
            reference_step(reference, opt, [llama_tokens(2, r) for r in range(2)])
        for key, value in reference.state_dict().items():
            assert torch.allclose(trained[key], value, rtol=0, atol=1e-12), key
        merged_dir = str(tmp_path / "merged")
        loaded = LlamaForCausalLM.from_pretrained(merged_dir, dtype=torch.float64)
        want = copy.deepcopy(reference).merge_and_unload().state_dict()
        assert loaded.state_dict().keys() == want.keys()
        for key, value in want.items():
            assert torch.allclose(loaded.state_dict()[key], value, rtol=0, atol=1e-12), key
        torch.manual_seed(0)
        again = PeftModel.from_pretrained(LlamaForCausalLM(config), str(tmp_path / "adapter"))
        for key, value in again.state_dict().items():
            if "lora_" in key or "modules_to_save" in key:
                assert torch.equal(value, trained[key]), key
