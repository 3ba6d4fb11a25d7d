"""`px.prepare(peft_model, ..., init=px.from_safetensors(path))`: a LoRA model built on the meta
device reads its base weights from files written with the plain model's names, each rank the
slices it keeps, and draws its adapters as PEFT's own initialisation does.

A Llama-shaped model of our own (an embedding tied to the head and left out of the files, a
rotary embedding's non-persistent buffer, attention and a gated MLP, RMSNorm) wrapped as PEFT's
`get_peft_model` wraps one: the base under `base_model.model.`, and each adapted projection a
LoRA layer holding the original as `base_layer` beside `lora_A.default` and `lora_B.default`,
initialised as PEFT initialises them (A drawn as nn.Linear draws, B zero). Against the same
model built whole in one process from the same seed, with the file's values, in float64: the
loaded values bit for bit, then three AdamW steps to 1e-12; a path (str or os.PathLike) as
`init=`; the model on meta given no `init=` drawn as the whole build draws it (B zero); a
tensor whose dtype the model's cannot hold exactly refused on every rank; and the peak resident
memory of a zero3 rank below one copy of the model. The last test does the same with PEFT's
own LoRA Llama, where peft and transformers are installed (CI installs neither).
"""

from __future__ import annotations

import math
import pathlib
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from resident import reset_peak, status
from safetensors.torch import save_file
from test_from_safetensors import default_dtype, write

import phalanx as px
from phalanx.testing import engine_of, run_ranks

SMALL = dict(vocab=29, d=16, heads=2, ffn=24, layers=2, r=4)
BIG = dict(vocab=8000, d=512, heads=8, ffn=1536, layers=6, r=8)  # 24.5M parameters, 98 MB
BATCH, TOKENS, STEPS = 4, 7, 3  # BATCH rows in all, whole over 2 ranks
SEED = 1234  # the adapters' draws, on rank 0 (rank 1 seeds another: rank 0's state is used)


# -- a Llama of our own ------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Rotary(nn.Module):
    """A non-persistent buffer, in no file: its own reset_parameters computes it."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, self.dim, 2) / self.dim))

    def forward(self, t):
        angles = torch.outer(torch.arange(t, dtype=self.inv_freq.dtype), self.inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False)
                                                              for _ in range(4))

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                             is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(d), Attention(d, heads)
        self.post_attention_layernorm, self.mlp = RMSNorm(d), MLP(d, ffn)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, vocab, d, heads, ffn, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.rotary_emb = Rotary(d // heads)
        self.layers = nn.ModuleList(Layer(d, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)

    def forward(self, tokens):
        h = self.embed_tokens(tokens)
        cos, sin = self.rotary_emb(tokens.shape[1])
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class CausalLM(nn.Module):
    """Hugging Face's shape: `model.` then the decoder; `lm_head` tied to the embedding."""

    def __init__(self, vocab, d, heads, ffn, layers, r=None):
        super().__init__()
        self.model = Decoder(vocab, d, heads, ffn, layers)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens):
        return self.lm_head(self.model(tokens))


# -- PEFT's LoRA wrapping, as get_peft_model makes it --------------------------------------------
class LoraLinear(nn.Module):
    """peft.tuners.lora.Linear: the wrapped layer as `base_layer`, the adapter's pair in
    ModuleDicts keyed by the adapter's name, A drawn as nn.Linear draws and B zero."""

    def __init__(self, base_layer, r):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base_layer.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base_layer.out_features,
                                                          bias=False)})
        self.scaling = 2.0
        self.reset_lora_parameters("default", True)

    def reset_lora_parameters(self, adapter_name, init_lora_weights):
        if init_lora_weights is False:
            return
        nn.init.kaiming_uniform_(self.lora_A[adapter_name].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[adapter_name].weight)

    def forward(self, x):
        adapter = self.lora_B["default"](self.lora_A["default"](x))
        return self.base_layer(x) + adapter * self.scaling


class LoraModel(nn.Module):
    def __init__(self, model, r, targets=("q_proj", "v_proj")):
        super().__init__()
        self.model = model
        model.requires_grad_(False)
        for name, module in list(model.named_modules()):
            if name.rsplit(".", 1)[-1] in targets:
                model.set_submodule(name, LoraLinear(module, r))


class PeftModel(nn.Module):
    def __init__(self, model, r):
        super().__init__()
        self.base_model = LoraModel(model, r)

    def forward(self, tokens):
        return self.base_model.model(tokens)


def lora_model(sizes, meta, file=None, seed=SEED) -> PeftModel:
    """The LoRA model of `sizes`: on meta (nothing drawn), or whole with the base from `file`
    (a state_dict of the plain model) and the adapters drawn from `seed`."""
    if meta:
        with torch.device("meta"):
            return PeftModel(CausalLM(**sizes), sizes["r"])
    torch.manual_seed(0)
    base = CausalLM(**sizes)
    if file is not None:
        base.load_state_dict(file, strict=False)  # the tied head is not in it
    torch.manual_seed(seed)
    return PeftModel(base, sizes["r"])


def pretrained(sizes) -> dict:
    """A plain CausalLM's weights as Hugging Face writes them: the tied head left out."""
    torch.manual_seed(99)
    model = CausalLM(**sizes)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # not the ones a reset would give
    return {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def tokens(step, world, rank):
    g = torch.Generator().manual_seed(step)
    rows = torch.randint(0, SMALL["vocab"], (BATCH, TOKENS), generator=g)
    per = BATCH // world
    return rows[rank * per:(rank + 1) * per]


def loss_of(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def optimizer_for(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen parameters in it too


def _load_and_train(cases):
    out = []
    for init, strategy, meta in cases:
        with default_dtype(torch.float64):
            model = lora_model(SMALL, meta=True) if meta else \
                lora_model(SMALL, meta=False, seed=SEED + px.rank())  # rank 0's is kept
            torch.manual_seed(SEED + px.rank())  # rank 0's generator draws the adapters
            opt = optimizer_for(model)
            model, opt = px.prepare(model, opt, strategy=strategy, init=init)
            loaded = {k: v.clone() for k, v in model.state_dict().items()}
            inv_freq = px.unwrap(model).base_model.model.model.rotary_emb.inv_freq.clone()
            for step in range(STEPS):
                loss_of(model, tokens(step, px.world_size(), px.rank())).backward()
                opt.step()
                opt.zero_grad()
            out.append((loaded, inv_freq, {k: v.clone() for k, v in model.state_dict().items()},
                        getattr(init, "read_bytes", None)))
    return out


def test_a_lora_model_on_meta_reads_the_plain_models_files_and_trains_as_one_process(tmp_path):
    """zero3 from px.from_safetensors(dir), ddp from the directory as a str, zero3 from the
    file as a pathlib.Path; and zero3 from a model built whole, whose ranks drew other
    adapters (rank 0's are kept)."""
    with default_dtype(torch.float64):
        file = pretrained(SMALL)
        directory = write(tmp_path / "llama", file)
        reference = lora_model(SMALL, meta=False, file=file)
        want_loaded = {k: v.clone() for k, v in reference.state_dict().items()}
        inv_freq = reference.base_model.model.model.rotary_emb.inv_freq.clone()
        opt = optimizer_for(reference)
        for step in range(STEPS):
            loss_of(reference, tokens(step, 1, 0)).backward()
            opt.step()
            opt.zero_grad()
        want_trained = reference.state_dict()
    adapters = [k for k in want_loaded if "lora_" in k]
    assert len(adapters) == 2 * 2 * SMALL["layers"]
    assert all(not torch.any(want_loaded[k]) for k in adapters if "lora_B" in k)  # PEFT's B
    cases = [(px.from_safetensors(directory), "zero3", True), (directory, "ddp", True),
             (pathlib.Path(directory) / "model.safetensors", "zero3", True),
             (directory, "zero3", False)]
    file_bytes = sum(t.numel() * t.element_size() for t in file.values())
    for results in run_ranks(_load_and_train, 2, args=(cases,), timeout=300):
        for (init, strategy, meta), (loaded, got_inv_freq, trained, _) in zip(cases, results):
            context = (str(init), strategy, meta)
            assert loaded.keys() == want_loaded.keys(), context
            for key, value in want_loaded.items():  # the file's weights, the adapters' own init
                assert torch.equal(loaded[key], value), (context, key)
            assert torch.equal(got_inv_freq, inv_freq), context
            for key, value in want_trained.items():
                assert torch.allclose(trained[key], value, rtol=0, atol=1e-12), (context, key)
            for key in adapters:
                assert not torch.equal(trained[key], want_loaded[key]), (context, key)
        assert results[0][3] < file_bytes  # zero3 on 2 ranks read its share, not the whole file


# -- a meta build with no init= -----------------------------------------------------------------
class Reaching(nn.Linear):
    """An adapter's layer whose reset_parameters also writes a weight of the base (`other`,
    not a child), which no draw of one module at a time can run."""

    def __init__(self, linear, other):
        super().__init__(linear.in_features, linear.out_features, bias=False)
        self.__dict__["other"] = other

    def reset_parameters(self):
        super().reset_parameters()
        if "other" in self.__dict__:
            nn.init.zeros_(self.__dict__["other"].weight)


def _drawn_without_init(directory):
    """The LoRA model built on meta and prepared with no init= under zero3 and ddp, rank 0's
    generator at SEED; then, under ddp, an adapter that writes outside its module refused
    with no init= and with init=directory."""
    drawn, messages = {}, {}
    for strategy in ("zero3", "ddp"):
        with default_dtype(torch.float64):
            torch.manual_seed(SEED + px.rank())  # rank 0's state is the one drawn from
            model = lora_model(SMALL, meta=True)
            model, _ = px.prepare(model, optimizer_for(model), strategy=strategy)
            drawn[strategy] = {k: v.clone() for k, v in model.state_dict().items()}
    for init in (None, directory):
        model = lora_model(SMALL, meta=True)
        decoder = model.base_model.model.model
        lora = decoder.layers[1].self_attn.v_proj
        with torch.device("meta"):
            lora.lora_A["default"] = Reaching(lora.lora_A["default"], decoder.norm)
        with pytest.raises(RuntimeError) as info:
            px.prepare(model, optimizer_for(model), strategy="ddp", init=init)
        messages[init] = str(info.value)
    return drawn, messages


def test_a_lora_model_on_meta_with_no_init_draws_what_a_whole_build_draws(tmp_path):
    """Without init=, the base is drawn first (each module's reset_parameters, in order) and
    the adapters after it as get_peft_model draws them: under zero3 and ddp, every value
    equals the model built whole from the same seed, in float64, PEFT's B zero. A draw that
    writes outside its module is refused by name, and the message says why the modules are
    drawn one at a time and what to do, under ddp too."""
    directory = write(tmp_path / "llama", pretrained(SMALL))
    with default_dtype(torch.float64):
        torch.manual_seed(SEED)
        whole = PeftModel(CausalLM(**SMALL), SMALL["r"]).state_dict()
    lora_b = [k for k in whole if ".lora_B." in k]
    assert len(lora_b) == 2 * SMALL["layers"] and not any(torch.any(whole[k]) for k in lora_b)
    for drawn, messages in run_ranks(_drawn_without_init, 2, args=(directory,), timeout=240):
        for strategy, values in drawn.items():
            assert values.keys() == whole.keys(), strategy
            for key, value in whole.items():
                assert torch.equal(values[key], value), (strategy, key)
        layer = "base_model.model.model.layers.1.self_attn.v_proj"
        for init, why in ((None, "but a PEFT model built on the meta device is drawn one module "
                                 "at a time, its base first and its adapters after it"),
                          (directory, "but the adapters that no file has are drawn one module "
                                      "at a time: build the model off the meta device")):
            assert f"Reaching.reset_parameters() of '{layer}.lora_A.default' writes " \
                   "'base_model.model.model.norm.weight', outside its own module tree, " \
                   f"{why}" in messages[init], messages[init]
            assert "zero3" not in messages[init]


# -- refusals -----------------------------------------------------------------------------------
def _refusals(directories, good):
    """Each bad file refused on every rank, the model left on meta; then the good one loads in
    the same group (no rank was left behind in a collective)."""
    messages = {}
    for name, directory in directories.items():
        model = lora_model(SMALL, meta=True)
        with pytest.raises(ValueError) as info:
            px.prepare(model, optimizer_for(model), strategy="zero3", init=directory)
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()]), name
        messages[name] = str(info.value)
    model = lora_model(SMALL, meta=True)
    model, _ = px.prepare(model, optimizer_for(model), strategy="zero3", init=good)
    return messages, model.state_dict()["base_model.model.model.embed_tokens.weight"]


def test_a_dtype_that_cannot_be_cast_exactly_or_a_base_weight_missing_is_refused_on_every_rank(
        tmp_path):
    file = pretrained(SMALL)  # float32, as the model
    good = write(tmp_path / "good", file)
    up = "model.layers.1.mlp.up_proj.weight"
    q = "model.layers.0.self_attn.q_proj.weight"
    directories = {
        "int32": write(tmp_path / "int32", {**file, up: (file[up] * 10).to(torch.int32)}),
        "float64": write(tmp_path / "float64", {**file, up: file[up].double()}),
        "missing": write(tmp_path / "missing", {k: v for k, v in file.items() if k != q}),
    }
    for messages, embed in run_ranks(_refusals, 2, args=(directories, good), timeout=240):
        for name, dtype in (("int32", "int32"), ("float64", "float64")):
            assert "does not fit the model, so nothing was loaded: 1 key of a dtype that the " \
                   f"model's does not hold exactly: {up!r} is {dtype} in the files but " \
                   "float32 in the model" in messages[name], messages[name]
            assert "build the model in the files' dtype" in messages[name]
        assert "1 key missing from the files: " \
               "'base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight' " \
               f"(in the files: {q!r}). The files' names must be the model's state_dict() keys" \
               in messages["missing"], messages["missing"]
        assert torch.equal(embed, file["model.embed_tokens.weight"])


@pytest.mark.one_process
def test_widening_is_exact_and_loads_narrowing_and_other_kinds_do_not(tmp_path):
    """The rule of exact casts, file dtype -> model dtype, through the plan in one process."""
    from phalanx.model.pretrained import exact_cast

    for src, dst in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                     (torch.float32, torch.float64), (torch.bfloat16, torch.float64),
                     (torch.int8, torch.int64), (torch.bool, torch.bool),
                     (torch.float32, torch.float32), (torch.float8_e4m3fn, torch.bfloat16),
                     (torch.float8_e5m2, torch.float16)):
        assert exact_cast(src, dst), (src, dst)
    for src, dst in ((torch.float64, torch.float32), (torch.float32, torch.bfloat16),
                     (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16),
                     (torch.int32, torch.float32), (torch.int64, torch.float64),
                     (torch.float32, torch.int32), (torch.int64, torch.int32),
                     (torch.uint8, torch.int8), (torch.bool, torch.float32),
                     (torch.float32, torch.complex64), (torch.float32, torch.float8_e4m3fn),
                     (torch.float8_e4m3fn, torch.float8_e5m2), (None, torch.float32)):
        assert not exact_cast(src, dst), (src, dst)
    file = {k: v.to(torch.bfloat16) for k, v in pretrained(SMALL).items()}
    with default_dtype(torch.float32):
        model = lora_model(SMALL, meta=False)
    px.from_safetensors(write(tmp_path / "bf16", file))(model)  # bf16 into fp32: exact
    base = model.base_model.model.state_dict()
    for key, value in file.items():
        wrapped = key.replace("q_proj.", "q_proj.base_layer.").replace("v_proj.",
                                                                       "v_proj.base_layer.")
        assert torch.equal(base[wrapped], value.float()), key


@pytest.mark.one_process
def test_what_the_files_lack_is_drawn_only_where_peft_would_draw_it(tmp_path):
    """A LoRA initialisation that reads the base weights (PiSSA, OLoRA...) and an adapter
    nothing can draw are refused by name, the former by a meta build with no init= too; a
    weight outside any adapter stays a missing key."""
    from phalanx.model.materialize import plain_draws

    directory = write(tmp_path / "llama", pretrained(SMALL))
    model = lora_model(SMALL, meta=True)
    model.peft_config = {"default": types.SimpleNamespace(init_lora_weights="olora")}
    for plan in (px.from_safetensors(directory).plan, plain_draws):
        with pytest.raises(ValueError, match="the LoRA adapter 'default' of "
                                             "'base_model.model.model.layers.0.self_attn.q_proj' "
                                             "is initialised with init_lora_weights='olora' "
                                             "\\(and 3 more\\)"):
            plan(model)
    model = lora_model(SMALL, meta=True)
    lora = model.base_model.model.model.layers[1].self_attn.v_proj
    with torch.device("meta"):
        lora.lora_C = nn.ParameterDict({"default": nn.Parameter(torch.empty(3))})
    with pytest.raises(ValueError, match="1 of the adapters' parameters in no file and on "
                                         "the meta device that nothing draws: "
                                         "'base_model.model.model.layers.1.self_attn.v_proj."
                                         "lora_C.default' \\(ParameterDict has no "
                                         "reset_parameters\\(\\)"):
        px.from_safetensors(directory).plan(model)
    model = lora_model(SMALL, meta=True)
    with torch.device("meta"):
        model.base_model.model.model.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="2 keys missing from the files: "
                                         "'base_model.model.model.extra.weight' \\(in the files: "
                                         "'model.extra.weight'\\)"):
        px.from_safetensors(directory).plan(model)


class PromptLearning(nn.Module):
    """PEFT's wrapper for prompt learning: the model itself as `base_model`, and beside it a
    prompt encoder (an adapter of its own) and the model's embedding again."""

    def __init__(self, model):
        super().__init__()
        self.base_model = model
        model.requires_grad_(False)
        self.prompt_encoder = nn.ModuleDict({"default": nn.Embedding(3, SMALL["d"])})
        self.word_embeddings = model.model.embed_tokens


class ModulesToSave(nn.Module):
    """PEFT's ModulesToSaveWrapper: the original module and a trained copy of it per adapter."""

    def __init__(self, module):
        super().__init__()
        self.original_module = module.requires_grad_(False)
        self.modules_to_save = nn.ModuleDict({"default": RMSNorm(module.weight.shape[0])})


@pytest.mark.one_process
def test_prompt_learning_and_modules_to_save_read_the_plain_models_names(tmp_path):
    """Prompt learning's `base_model.` and the two copies of a module in modules_to_save are
    read from the plain model's names; a prompt encoder on meta is drawn by its own
    reset_parameters, and kept as it is off meta."""
    file = pretrained(SMALL)
    directory = write(tmp_path / "llama", file)
    with torch.device("meta"):
        model = PromptLearning(CausalLM(**SMALL))
    reading = px.from_safetensors(directory).plan(model)
    assert reading.adapters.drawn == [("prompt_encoder.default", "weight")]
    assert reading.adapters.order == [("prompt_encoder.default", "reset")]
    assert {e.key for e in reading.entries if e.key} == set(file)
    model = lora_model(SMALL, meta=False)
    decoder = model.base_model.model.model
    decoder.norm = ModulesToSave(decoder.norm)
    model = PromptLearning(model.base_model.model)  # a model of both wrappings' names
    encoder = model.prompt_encoder["default"].weight.clone()
    px.from_safetensors(directory)(model)
    for copy in (decoder.norm.original_module, decoder.norm.modules_to_save["default"]):
        assert torch.equal(copy.weight, file["model.norm.weight"])
    assert torch.equal(model.base_model.model.embed_tokens.weight,
                       file["model.embed_tokens.weight"])
    assert torch.equal(model.prompt_encoder["default"].weight, encoder)


# -- memory -------------------------------------------------------------------------------------
def _peak(directory, route):
    """The rise of this rank's resident high-water mark while the LoRA model is built and
    prepared under zero3 with the base weights of `directory`: "meta" (built on meta,
    init=px.from_safetensors), or "whole" (built whole, loaded in place, then prepared)."""
    torch.set_num_threads(1)
    warm = nn.Linear(2, 2)  # what a first prepare allocates once (gloo, imports) is not counted
    px.prepare(warm, torch.optim.SGD(warm.parameters(), lr=0.1), strategy="zero3")
    baseline = status("VmRSS")
    reset_peak()  # the high-water mark starts from here
    if route == "meta":
        model = lora_model(BIG, meta=True)
        init = px.from_safetensors(directory)
    else:
        base = CausalLM(**BIG)
        px.from_safetensors(directory)(base)
        model, init = PeftModel(base, BIG["r"]), None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, opt = px.prepare(model, opt, strategy="zero3", init=init)
    held = sum(t.numel() * t.element_size() for u in engine_of(model).all_units for t in u.held())
    return status("VmHWM") - baseline, held


def _big_file(tmp_path) -> tuple[str, int]:
    with default_dtype(torch.float32):
        torch.manual_seed(0)
        model = CausalLM(**BIG)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    save_file({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    del model
    return str(tmp_path), whole


def test_a_lora_model_on_meta_never_holds_a_whole_copy_of_the_model_on_a_rank(tmp_path):
    """98 MB of base weights, 2 ranks, zero3: a rank holds its half (49 MB) and what the
    engine allocates beside it, never the whole model (the route of a model built whole
    holds it all first: the test below)."""
    directory, whole = _big_file(tmp_path)
    for rise, held in run_ranks(_peak, 2, args=(directory, "meta"), timeout=240):
        assert whole / 2 <= held <= whole / 2 + 2**20, (held, whole)
        assert rise < whole, f"peak rise {rise / 1e6:.1f} MB >= the model's {whole / 1e6:.1f} MB"


@pytest.mark.slow  # the measure's own check (pages glibc reuses can hide part of a peak)
def test_the_peak_measure_sees_the_whole_model_of_the_route_built_whole(tmp_path):
    directory, whole = _big_file(tmp_path)
    for rise, _ in run_ranks(_peak, 2, args=(directory, "whole"), timeout=240):
        assert rise > whole, f"peak rise {rise / 1e6:.1f} MB: the whole model not seen"


# -- PEFT's own LoRA Llama ----------------------------------------------------------------------
def _hf_lora(config, meta, lora_config, directory=None):
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    if meta:  # inside the context PEFT makes its adapters on meta too, drawing nothing
        with torch.device("meta"):
            return get_peft_model(LlamaForCausalLM(config), lora_config)
    base = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64)
    torch.manual_seed(SEED)
    model = get_peft_model(base, lora_config)
    model.train()
    return model


def _hf_load_and_train(config, lora_configs, directory, cases):
    from test_from_safetensors_hf import llama_loss, llama_tokens

    out = []
    for which, strategy in cases:
        with default_dtype(torch.float64):
            model = _hf_lora(config, True, lora_configs[which])
            torch.manual_seed(SEED + px.rank())
            opt = optimizer_for(model)
            model, opt = px.prepare(model, opt, strategy=strategy,
                                    init=px.from_safetensors(directory))
            loaded = {k: v.clone() for k, v in model.state_dict().items()}
            llama_loss(model, llama_tokens(px.world_size(), px.rank())).backward()
            opt.step()
            out.append((loaded, {k: v.clone() for k, v in model.state_dict().items()}))
    return out


def test_peft_lora_llama_on_meta_loads_save_pretrained_files_as_a_whole_build(tmp_path):
    """get_peft_model on a meta Llama (adapters on q_proj and v_proj; and with lm_head in
    modules_to_save), its base from save_pretrained's files under zero3 and ddp at 2 ranks:
    every value equals from_pretrained then get_peft_model from the same seed, bit for bit,
    and one AdamW step equals one process to 1e-12."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("peft", reason="peft is not installed")
    from peft import LoraConfig, get_peft_model
    from test_from_safetensors_hf import llama_tokens
    from test_zero3_peft import reference_step
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32, tie_word_embeddings=False)
    lora_configs = {
        "lora": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "modules_to_save": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                      modules_to_save=["lm_head"]),
    }
    with default_dtype(torch.float64):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    directory = str(tmp_path / "llama")
    with torch.device("meta"):  # DoRA's magnitude is computed from the base weights
        dora = get_peft_model(LlamaForCausalLM(config),
                              LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="2 of the adapters' parameters in no file and on the "
                                         "meta device that nothing draws: 'base_model.model."
                                         "model.layers.0.self_attn.q_proj.lora_magnitude_vector"
                                         ".default.weight'"):
        px.from_safetensors(directory).plan(dora)
    cases = [("lora", "zero3"), ("lora", "ddp"), ("modules_to_save", "zero3")]
    results = run_ranks(_hf_load_and_train, 2, args=(config, lora_configs, directory, cases),
                        timeout=300)
    for i, (which, strategy) in enumerate(cases):
        with default_dtype(torch.float64):
            reference = _hf_lora(config, False, lora_configs[which], directory)
            loaded = {k: v.clone() for k, v in reference.state_dict().items()}
            reference_step(reference, optimizer_for(reference),
                           [llama_tokens(2, r) for r in range(2)])
        adapters = [k for k in loaded if "lora_" in k]
        assert adapters and all(not torch.any(loaded[k]) for k in adapters if "lora_B" in k)
        for rank, by_case in enumerate(results):
            got_loaded, got_trained = by_case[i]
            assert got_loaded.keys() == loaded.keys()
            for key, value in loaded.items():
                assert torch.equal(got_loaded[key], value), (which, strategy, rank, key)
            for key, value in reference.state_dict().items():
                assert torch.allclose(got_trained[key], value, rtol=0, atol=1e-12), \
                    (which, strategy, rank, key)
