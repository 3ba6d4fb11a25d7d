"""zero3's gathering (engine/zero3.py): prefetch in forward and backward order, the bound on
what is gathered at once, parameters kept from forward to backward, recomputation under
activation checkpointing, a forward that takes another path than the last one; all in float64
against one process with the whole batch, at 2, 3 and 4 ranks.

The models: a small transformer with tied input and output embeddings (vocabulary 13, divisible
by none of 2, 3, 4), three blocks, the first and last checkpointed (reentrant and not), and
block 1 skipped on odd steps
(by every rank: the order of the forward changes between steps); and a CNN with BatchNorm
(synchronized, so its statistics are those of the whole batch, as in one process).

Also here: the planner's prediction of that bound, a unit bigger than it, named block classes
(`blocks=`), and the checks of these options. Checkpointed blocks on their own, branches on the
rank, replaced parameters and two models in one process: test_zero3_unusual_forwards.py.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import phalanx as px
from phalanx.planner.layout import window
from phalanx.testing import engine_of, run_ranks

sys.path.insert(0, str(Path(__file__).parent))
from parity import CNN, Chain, one_thread, with_reference
from test_parity64 import make_optimizer

DTYPE = torch.float64
STEPS = 5
B = 2
VOCAB = 13
RTOL = 1e-10  # as in test_parity64.py, where the reference's own round-off is measured
# Each unit at most 256 float64 elements: every block is a root of several units.
BUCKET_MB = 0.002


class TiedBlocks(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=24, dropout=0.0,
                                       batch_first=True, bias=False) for _ in range(3))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, step=0):
        h = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if i == 1 and step % 2:
                continue  # another path on odd steps: what was prefetched goes unused
            # block 0 recomputed by the reentrant checkpoint, block 2 by the other kind
            h = checkpoint(block, h, use_reentrant=i == 0) if i != 1 else block(h)
        return self.head(self.norm(h))


MODELS = ("tied", "cnn")
GATHERING = {  # name -> px.prepare options (the default, prefetch=1, is test_parity64.py's)
    "no-prefetch": {"prefetch": 0},
    "prefetch-2-bounded": {"prefetch": 2, "max_gathered_mb": 0.04},  # 2.8 blocks
    "keep-until-backward": {"reshard_after_forward": False},
}
# Both optimizers and accumulation on and off, in two pairs; the slow case: the other two.
OPT_ACCUM = [pytest.param([("sgd", 2), ("adamw", 1)], id="sgd-accum2+adamw-accum1"),
             pytest.param([("sgd", 1), ("adamw", 2)], id="sgd-accum1+adamw-accum2",
                          marks=pytest.mark.slow)]


def _combos(opt_accum):
    return [(model, gathering, opt, accum) for model in MODELS for gathering in GATHERING
            for opt, accum in opt_accum]


def make_model(name):
    torch.manual_seed(7)
    return (TiedBlocks() if name == "tied" else CNN()).to(DTYPE)


def make_data(name, rows, step):
    g = torch.Generator().manual_seed(500 + step)
    if name == "tied":
        tokens = torch.randint(0, VOCAB, (rows, 7), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return (torch.randn(rows, 3, 6, 6, generator=g, dtype=DTYPE),
            torch.randn(rows, 4, generator=g, dtype=DTYPE))


def loss_of(name, model, x, y, step):
    if name == "tied":
        logits = model(x, step)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    return F.mse_loss(model(x), y)


def reference(name, opt_kind, world, accum):
    """One process; micro-step a is the rows every rank takes at its micro-step a, together
    (BatchNorm's statistics are per micro-step, over all ranks)."""
    with one_thread():
        model = make_model(name)
        opt = make_optimizer(opt_kind, model)
        for step in range(STEPS):
            x, y = make_data(name, world * accum * B, step)
            rows = world * B
            for a in range(accum):
                part = slice(a * rows, (a + 1) * rows)
                (loss_of(name, model, x[part], y[part], step) / accum).backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict(), opt.state_dict()


def _train(name, gathering, opt_kind, world, accum):
    model = make_model(name)
    opt = make_optimizer(opt_kind, model)
    model, opt = px.prepare(model, opt, strategy="zero3", bucket_mb=BUCKET_MB,
                            sync_batchnorm=name == "cnn", **GATHERING[gathering])
    rank = px.rank()
    for step in range(STEPS):
        x, y = make_data(name, world * accum * B, step)
        for a in range(accum):
            rows = slice((a * world + rank) * B, (a * world + rank + 1) * B)
            with contextlib.nullcontext() if a == accum - 1 else px.no_sync(model):
                (loss_of(name, model, x[rows], y[rows], step) / accum).backward()
        opt.step()
        opt.zero_grad()
    gatherer = engine_of(model).gatherer
    freed = all(p.untyped_storage().size() == 0 for p in px.unwrap(model).parameters())
    counts = {"prefetched": gatherer.prefetched, "unused": gatherer.prefetched_unused,
              "peak_bytes": gatherer.peak_bytes, "freed": freed}
    return ({k: v.clone() for k, v in model.state_dict().items()}, px.optimizer_state_dict(opt),
            counts)


def _train_all(world, combos):
    return {combo: _train(*combo[:3], world, combo[3]) for combo in combos}


def assert_close(got, want, context):
    assert got.shape == want.shape, context
    if not want.is_floating_point():
        assert torch.equal(got, want), context
        return
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    assert err <= RTOL * scale + 1e-13, f"{context}: differs by {err:.3e} (scale {scale:.3e})"


@pytest.mark.parametrize("opt_accum", OPT_ACCUM)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_zero3_gathering_options_keep_float64_parity_with_one_process(world, opt_accum):
    combos = _combos(opt_accum)
    results = run_ranks(_train_all, world, args=(world, combos), timeout=300)
    for combo in combos:
        name, gathering, opt_kind, accum = combo
        want_params, want_state = reference(name, opt_kind, world, accum)
        for rank, got in enumerate(results):
            params, state, counts = got[combo]
            context = f"{combo} world {world} rank {rank}"
            assert params.keys() == want_params.keys(), context
            for key, value in want_params.items():
                assert_close(params[key], value, f"{context}: {key}")
            assert sorted(state["state"]) == sorted(want_state["state"]), context
            for index, entries in want_state["state"].items():
                for key, value in entries.items():
                    got_value = state["state"][index][key]
                    if isinstance(value, torch.Tensor):
                        assert_close(got_value, value.to(got_value.dtype),
                                     f"{context}: state[{index}][{key}]")
                    else:
                        assert got_value == value, context
            assert counts["freed"], f"{context}: a parameter kept storage between steps"
            if gathering == "no-prefetch":
                assert counts["prefetched"] == 0, context
            else:
                assert counts["prefetched"] > 0, f"{context}: nothing was prefetched"
            if name == "tied" and gathering != "no-prefetch":
                # block 1 is skipped on odd steps: what was gathered for it on the strength
                # of the last order went unused (and was freed), and training is unchanged
                assert counts["unused"] > 0, context


def _peaks(options):
    torch.manual_seed(3)
    model = Chain([nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    model, opt = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            strategy="zero3", **options)
    for _ in range(3):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    gatherer = engine_of(model).gatherer
    return (gatherer.peak_bytes, gatherer.prefetched, len(gatherer.roots),
            sum(u.full_bytes for u in gatherer.roots[1].units))


def _planned_gathered(options):
    model = Chain([nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    return px.plan(model, gpus=2, strategy="zero3", precision="fp32", optimizer="sgd-momentum",
                   backend="gloo", input_shape="64", **options)["zero3"] \
        .buffers_detail["gathered_params"]


def test_the_bound_on_what_is_gathered_at_once_holds():
    """Six equal blocks of 16.6 kB: prefetching 4 ahead gathers 5 at once; a bound of 2.5
    blocks lets 2 be gathered at once; prefetch=0 gathers 1; kept until backward, all 6. The
    planner, given the same options, predicts each."""
    bound = {"prefetch": 4, "max_gathered_mb": 2.5 * 64 * 65 * 4 / 2**20}
    far, far_count, roots, block = run_ranks(_peaks, 2, args=({"prefetch": 4},))[0]
    bounded, bounded_count, _, _ = run_ranks(_peaks, 2, args=(bound,))[0]
    none, none_count, _, _ = run_ranks(_peaks, 2, args=({"prefetch": 0},))[0]
    kept, _, _, _ = run_ranks(_peaks, 2, args=({"reshard_after_forward": False},))[0]
    assert roots == 6 and block == 64 * 65 * 4
    assert none == block and none_count == 0
    assert far == 5 * block and far_count > 0
    assert bounded == 2 * block and bounded_count > 0
    assert kept == 6 * block
    for options, peak in (({"prefetch": 4}, far), (bound, bounded), ({"prefetch": 0}, none),
                          ({"reshard_after_forward": False}, kept), ({}, 2 * block)):
        assert _planned_gathered(options) == peak, options


def _oversized():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="zero3",
                   max_gathered_mb=0.001)
    # phalanx's own warnings only: torch may warn about something else in a fresh process
    return [str(w.message) for w in caught if str(w.message).startswith("zero3:")]


def test_a_unit_bigger_than_the_bound_is_named_in_a_warning():
    """Once, from rank 0: the unit is still gathered whole when it computes."""
    first, second = run_ranks(_oversized, 2)
    assert second == []
    assert len(first) == 1 and "max_gathered_mb=0.001 is below what these units need on " \
        "their own: 'the model' (17.3 KiB)" in first[0], first


@pytest.mark.one_process
@pytest.mark.parametrize("options, match", [
    ({"prefetch": -1}, "prefetch=-1: how many blocks to gather ahead"),
    ({"prefetch": True}, "prefetch=True"),
    ({"max_gathered_mb": 0}, "max_gathered_mb=0: a positive number"),
    ({"strategy": "zero2", "max_gathered_mb": 10}, "are zero3's: strategy 'zero2'"),
    ({"strategy": "zero1", "prefetch": 2}, "prefetch, max_gathered_mb and reshard_after_forward "
                                           "are zero3's: strategy 'zero1'"),
    ({"strategy": "ddp", "reshard_after_forward": False}, "are zero3's: strategy 'ddp'"),
])
def test_gathering_options_are_checked_before_anything_else(options, match):
    model = nn.Linear(4, 4)
    options = {"strategy": "zero3", **options}
    with pytest.raises(ValueError, match=match):
        px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)


class Layer(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Sequential4(nn.Module):
    """Repeated layers in an nn.Sequential: no ModuleList for the default rule to find."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.layers = nn.Sequential(*(Layer() for _ in range(4)))
        self.out = nn.Linear(32, 3)

    def forward(self, x):
        return self.out(self.layers(self.inp(x)))


def _named_blocks(blocks):
    torch.manual_seed(0)
    model = Sequential4().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = px.prepare(model, opt, strategy="zero3", blocks=blocks)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 8, generator=g, dtype=DTYPE)[px.rank() * 2:(px.rank() + 1) * 2]
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    gatherer = engine_of(model).gatherer
    return ([r.name for r in gatherer.roots], gatherer.peak_bytes,
            {k: v.clone() for k, v in model.state_dict().items()})


def test_named_block_classes_become_the_units_gathered_one_at_a_time():
    """blocks=Layer (or its name): each layer is gathered on its own, one prefetched beside it,
    as the planner predicts; the training is the same, in float64, as with the default units."""
    default = run_ranks(_named_blocks, 2, args=(None,))
    named = run_ranks(_named_blocks, 2, args=(Layer,))
    by_name = run_ranks(_named_blocks, 2, args=("Layer",))
    roots, peak, state = named[0]
    assert roots == by_name[0][0]
    assert {f"layers.{i}" for i in range(4)} <= set(roots)
    assert not any(r.startswith("layers.") for r in default[0][0])  # one root held them all
    layer = sum(p.numel() for p in Layer().parameters())
    assert peak == 2 * layer * 8 < default[0][1]  # measured: 67072 bytes against 137248
    planned = px.plan(Sequential4().double(), gpus=2, strategy="zero3", precision="fp32",
                      optimizer="adamw", backend="gloo", blocks="Layer", input_shape="8")
    assert planned["zero3"].buffers_detail["gathered_params"] == 2 * layer * 4  # fp32 there
    for got in named + by_name:
        for key, value in default[0][2].items():
            torch.testing.assert_close(got[2][key], value, rtol=1e-12, atol=1e-14)


@pytest.mark.one_process
@pytest.mark.parametrize("blocks, match", [
    ("Nope", "blocks: no module of class 'Nope' in the model"),
    (nn.Conv2d, "blocks: no module of class 'Conv2d' in the model"),
    (Sequential4, "blocks: the model itself is a Sequential4"),
    (3, "blocks=3: a module class, a class name, or a tuple of them"),
    (nn.ModuleList, "blocks: ModuleList is a container that is never called; name the class "
                    "of the layers it holds"),
])
def test_block_classes_that_name_nothing_are_refused(blocks, match):
    model = Sequential4()
    with pytest.raises(ValueError, match=match):
        px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="zero3",
                   blocks=blocks)


class _Decoder(nn.Module):
    """Hugging Face's nesting: the embedding inside the decoder, beside its layers."""

    def __init__(self, vocab=64, d=8):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(4))
        self.norm = nn.LayerNorm(d)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.norm(h)


class _CausalLM(nn.Module):
    def __init__(self, vocab=64, d=8):
        super().__init__()
        self.model = _Decoder(vocab, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))

    def get_input_embeddings(self):  # as every Hugging Face model says which they are
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head


# units of at most 196 float64 (393 fp32, as the planner counts) elements: the head and the
# embedding (512) each alone, a layer (72) one unit
HEAD_APART = 0.0015


class _WithLoss(nn.Module):
    """A module of the user's around the causal LM, its forward the logits (as one computing
    the loss from the decoder's states would be)."""

    def __init__(self):
        super().__init__()
        self.lm = _CausalLM()

    def forward(self, ids):
        return self.lm(ids)


def _nested_embedding(wrapped=False):
    torch.manual_seed(0)
    model, reference, opt, ref_opt = with_reference(
        lambda: (_WithLoss() if wrapped else _CausalLM()).double())
    model, opt = px.prepare(model, opt, strategy="zero3", bucket_mb=HEAD_APART)
    g = torch.Generator().manual_seed(1)
    r, n = px.rank(), px.world_size()
    diffs = []
    for _ in range(3):
        ids = torch.randint(0, 64, (2 * n, 6), generator=g)
        loss = F.cross_entropy(model(ids[2 * r:2 * r + 2]).flatten(0, 1),
                               ids[2 * r:2 * r + 2].flatten())
        with torch.no_grad():
            diffs.append(abs(loss.item() - F.cross_entropy(
                reference(ids[2 * r:2 * r + 2]).flatten(0, 1), ids[2 * r:2 * r + 2].flatten())
                .item()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(reference(ids).flatten(0, 1), ids.flatten()).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    gatherer = engine_of(model).gatherer
    return [root.name for root in gatherer.roots], gatherer.peak_bytes, max(diffs)


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_input_embedding_inside_the_decoder_is_its_own_root(wrapped):
    """A Hugging Face causal LM's embedding sits in the decoder (`model.embed_tokens`), whose
    forward brackets every layer: rooted there, it would stay gathered through the whole
    decoder, forward and backward (and in a module of the user's around the LM, the head too,
    rooted at the whole LM). The model's `get_input_embeddings()` and
    `get_output_embeddings()` are roots of their own, the embedding gathered beside the first
    layer only:
    the measured peak is the planner's (the embedding or the head beside the layer next to it,
    never the two together), and training equals one process in float64."""
    roots, peak, diff = run_ranks(_nested_embedding, 2, args=(wrapped,), timeout=120)[0]
    prefix = "lm." if wrapped else ""  # the model inside a module of the user's: found there
    assert f"{prefix}model.embed_tokens" in roots and f"{prefix}lm_head" in roots, roots
    assert diff < 1e-12, diff
    # the embedding beside the first layer, inside the decoder, which holds the final norm
    vocab, layer, norm = 64 * 8, 8 * 8 + 8, 2 * 8
    assert peak == 8 * (vocab + layer + norm), (peak, roots)  # float64: 8 bytes an element
    planned = px.plan((_WithLoss() if wrapped else _CausalLM()).double(), gpus=2,
                      strategy="zero3", precision="fp32",
                      backend="gloo", input_shape="6", input_dtype="int64",
                      bucket_mb=HEAD_APART)["zero3"]
    assert planned.buffers_detail["gathered_params"] == 4 * (vocab + layer + norm)  # fp32


@pytest.mark.one_process
def test_a_root_that_brackets_others_is_counted_with_them():
    """In backward's order of units a decoder holding the final norm comes between the head
    and the last layer, which are gathered together at the end of the forward (the head
    prefetched while the last layer computes, inside the decoder): the planner's window counts
    the decoder with every root inside it and never as a neighbour of its own."""
    sizes = {"lm_head": 32000, "model": 16, "model.layers.1": 72, "model.layers.0": 72,
             "model.embed_tokens": 8000}
    assert window(sizes, 2) == 32000 + 72 + 16
    assert window(sizes, 1) == 32000  # the head alone: the decoder is not running then
    assert window([5, 1, 7, 2], 2) == 9 and window([], 2) == 0
