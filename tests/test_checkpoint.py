"""px.save / px.load resume training on real ranks (gloo), in float64: at another world size,
strategy or precision, and bit for bit (RNG included) at the same ones; the sampler too.

A run is split in two: train K steps, save, and in fresh processes (another world size,
strategy or precision) build the model from another seed, prepare, load, train K more steps.
The result is compared with one process that trained 2K steps on the same global batches.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkpoint_runs import (
    GLOBAL_BATCH,
    K,
    TiedLM,
    make_batch,
    make_model,
    make_optimizer,
    state_of,
    train_steps,
)

import phalanx as px
from phalanx.testing import run_ranks


def _first_half(path, strategy, precision):
    torch.manual_seed(7 + px.rank())  # only the broadcast makes the ranks agree
    model = make_model(0)
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    train_steps(model, opt, K, 0, px.world_size(), px.rank())
    px.save(path, model=model, optimizer=opt, step=K)
    return True


def _second_half(path, strategy, precision):
    model = make_model(99 + px.rank())  # other values everywhere: only the load can set them
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    values = px.load(path, model=model, optimizer=opt)
    assert values == {"step": K}
    train_steps(model, opt, K, K, px.world_size(), px.rank())
    return state_of(model, opt)


def _reference():
    model = make_model(0)
    opt = make_optimizer(model)
    train_steps(model, opt, 2 * K, 0, 1, 0)
    return state_of(model, opt)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _assert_close(got, want, rtol):
    params, optim = got
    ref_params, ref_optim = want
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        assert _rel(params[name], ref_params[name]) <= rtol, name
    assert optim.keys() == ref_optim.keys()
    for name in ref_optim:
        for key in ref_optim[name]:
            assert _rel(optim[name][key], ref_optim[name][key]) <= rtol, (name, key)


LAYOUTS = [(s, n) for s in ("ddp", "zero1", "zero2", "zero3") for n in (1, 2, 3, 4)]
QUICK_PAIRS = [
    (("ddp", 2), ("zero2", 3)),
    (("zero2", 3), ("ddp", 2)),
    (("zero1", 4), ("zero2", 2)),
    (("zero2", 2), ("zero1", 1)),
    (("zero3", 2), ("ddp", 3)),
    (("zero1", 3), ("zero3", 2)),
]


def _pair_id(saved, loaded):
    return "-to-".join("-".join(map(str, layout)) for layout in (saved, loaded))


# The slow cases: every other pair of 4 strategies x 1-4 ranks (256 pairs in all).
PAIRS = [pytest.param(a, b, id=_pair_id(a, b)) for a, b in QUICK_PAIRS] + [
    pytest.param(a, b, id=_pair_id(a, b), marks=pytest.mark.slow)
    for a in LAYOUTS for b in LAYOUTS if (a, b) not in QUICK_PAIRS]


@pytest.mark.parametrize("saved,loaded", PAIRS)
def test_a_checkpoint_resumes_at_another_world_size_and_strategy(tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    run_ranks(_first_half, saved[1], args=(path, saved[0], "fp32"), timeout=120)
    results = run_ranks(_second_half, loaded[1], args=(path, loaded[0], "fp32"), timeout=120)
    want = _reference()
    for got in results:
        _assert_close(got, want, 1e-12)


# -- the same world size and strategy: bit for bit, RNG included -------------------------------
def _noisy_run(path, strategy, mode):
    """Train with noise drawn from each rank's own RNG; mode: 'whole' (2K steps), 'save' (K
    steps, then save), 'resume' (load, then K steps)."""
    torch.manual_seed(5 + px.rank())
    model = make_model(0)
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy)
    rows = GLOBAL_BATCH // px.world_size()

    def steps(first, n):
        for step in range(first, first + n):
            tokens = make_batch(step)[px.rank() * rows:(px.rank() + 1) * rows]
            noise = torch.randn(rows, 4, 11, dtype=torch.float64) * 0.1  # this rank's RNG
            logits = model(tokens[:, :-1]) + noise
            F.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()

    if mode == "resume":
        torch.manual_seed(12345)  # a different RNG state: the load must restore it
        px.load(path, model=model, optimizer=opt)
        steps(K, K)
    else:
        steps(0, 2 * K if mode == "whole" else K)
        if mode == "save":
            px.save(path, model=model, optimizer=opt)
            return None
    return state_of(model, opt)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_resuming_at_the_same_world_size_is_bit_for_bit(tmp_path, strategy):
    path = str(tmp_path / "ckpt")
    whole = run_ranks(_noisy_run, 2, args=(path, strategy, "whole"))
    run_ranks(_noisy_run, 2, args=(path, strategy, "save"))
    resumed = run_ranks(_noisy_run, 2, args=(path, strategy, "resume"))
    for got, want in zip(resumed, whole):
        for name in want[0]:
            assert torch.equal(got[0][name], want[0][name]), name
        for name in want[1]:
            for key in want[1][name]:
                assert torch.equal(got[1][name][key], want[1][name][key]), (name, key)


# -- the sampler: the next sample, at another world size ------------------------------------
def _save_loader_midway(path, world_batches):
    """Consume 2 batches of a px.data_loader, save the sampler; or load it and list the rest."""
    dataset = torch.utils.data.TensorDataset(torch.arange(60))
    loader = px.data_loader(dataset, batch_size=12 // px.world_size(), shuffle=True, seed=3)
    if world_batches == "save":
        it = iter(loader)
        seen = [next(it)[0], next(it)[0]]
        px.save(path, sampler=loader.sampler, step=2)
        return torch.cat(seen)
    px.load(path, sampler=loader.sampler)
    return torch.cat([b[0] for b in loader])


def test_the_sampler_resumes_at_the_next_sample_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    before = run_ranks(_save_loader_midway, 2, args=(path, "save"))
    after = run_ranks(_save_loader_midway, 3, args=(path, "rest"))
    seen = torch.cat(before).tolist() + torch.cat(after).tolist()
    assert sorted(seen) == list(range(60))  # every sample once: none skipped, none repeated


# -- across precisions: the masters and the optimizer state survive exactly -------------------
def _save_layout(path, strategy, precision):
    torch.manual_seed(0)
    model = TiedLM()
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    train_steps(model, opt, K, 0, px.world_size(), px.rank())
    px.save(path, model=model, optimizer=opt)
    px.export(path + ".safetensors", model)
    return px.optimizer_state_dict(opt)


def _load_layout(path, strategy, precision):
    model = TiedLM()
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    px.load(path, model=model, optimizer=opt)
    px.export(path + f".{px.world_size()}.safetensors", model)
    return px.optimizer_state_dict(opt)


# The slow cases: each strategy at 1-4 ranks in fp32 and bf16, loaded as zero2 x 3 in bf16 and
# as ddp x 2 in fp32.
PRECISION_PAIRS = [pytest.param(a, b, id=_pair_id(a, b)) for a, b in [
    (("zero2", 2, "bf16"), ("ddp", 3, "fp32")),
    (("zero1", 3, "fp32"), ("zero2", 2, "bf16")),
    (("ddp", 2, "fp16"), ("zero1", 4, "bf16"))]] + [
    pytest.param((s1, n1, p1), (s2, n2, p2), id=_pair_id((s1, n1, p1), (s2, n2, p2)),
                 marks=pytest.mark.slow)
    for s1 in ("ddp", "zero1", "zero2") for n1 in (1, 2, 3, 4) for p1 in ("fp32", "bf16")
    for s2, n2, p2 in [("zero2", 3, "bf16"), ("ddp", 2, "fp32")]]


@pytest.mark.parametrize("saved,loaded", PRECISION_PAIRS)
def test_masters_and_optimizer_state_survive_a_change_of_precision_exactly(tmp_path, saved,
                                                                          loaded):
    from safetensors.torch import load_file

    path = str(tmp_path / "ckpt")
    before = run_ranks(_save_layout, saved[1], args=(path, saved[0], saved[2]))[0]
    after = run_ranks(_load_layout, loaded[1], args=(path, loaded[0], loaded[2]))
    exported, reloaded = load_file(path + ".safetensors"), \
        load_file(path + f".{loaded[1]}.safetensors")
    assert exported.keys() == reloaded.keys()
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(loaded[2])
    for key, value in exported.items():
        if key.startswith("frozen.") and compute is not None:
            # a frozen parameter has no master: under bf16/fp16 it is held in that dtype
            value = value.to(compute).float()
        assert torch.equal(reloaded[key], value), key  # trained: the fp32 masters, exactly
    for state in after:
        assert state["state"].keys() == before["state"].keys()
        for index, entry in before["state"].items():
            for key, value in entry.items():
                assert torch.equal(state["state"][index][key], value), (index, key)
