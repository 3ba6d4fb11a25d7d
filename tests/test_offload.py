"""`px.prepare(..., offload=...)`: the masters and the optimizer state in host memory, stepped
there (engine/offload.py). On a machine without CUDA the same code runs with host buffers
distinct from the "device" ones, every copy made: in float64 every strategy that takes it
trains as one process does (the model of test_zero3_frozen.py, frozen layers mixed into units,
AdamW with clipping and accumulation), and as the same run without offload under bf16, fp16,
staleness=1, PowerSGD and other optimizers; checkpoints move between offloaded and not; the
host step uses torch's fused CPU kernels and shows in the step report; what offload cannot
take is refused by name.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from parity import one_thread
from test_parity64 import assert_state_dicts_equal
from test_zero3_frozen import (
    ACCUM,
    BUCKET_MB,
    CLIP,
    RTOL,
    SEED,
    STEPS,
    build,
    data,
    loss_of,
    optimizer_for,
    train,
)

import phalanx as px
from phalanx.testing import engine_of, run_ranks

WORLD = 2
CASES = [("zero1", "optimizer"), ("zero2", "optimizer"), ("zero3", "optimizer"),
         ("zero3", "params")]


def reference():
    with one_thread():
        model = build()
        opt = optimizer_for(model)
        for step in range(STEPS):
            x, y = data(step, WORLD * ACCUM * B_ROWS)
            loss_of(model, x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        return model.state_dict(), opt.state_dict()


B_ROWS = 2  # test_zero3_frozen's B


def _run(strategy, offload, precision="fp32", opt_kind="adamw", **options):
    model = build(SEED + px.rank())
    if opt_kind == "adamw":
        opt = optimizer_for(model)
    elif opt_kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:  # no fused kernel: foreach on the host
        opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision,
                            bucket_mb=BUCKET_MB, offload=offload, **options)
    train(model, opt)
    return model, opt, {k: v.clone() for k, v in model.state_dict().items()}, \
        copy.deepcopy(px.optimizer_state_dict(opt))  # ddp's is the optimizer's own, live


def _parity_and_pairs():
    out = {}
    for strategy, offload in CASES:  # against one process
        model, _, state, optim = _run(strategy, offload)
        engine = engine_of(model)
        units = engine.all_units
        out[(strategy, offload)] = {
            "state": state, "optim": optim, "report": px.step_stats(model),
            # the masters are tensors of their own, apart from the full buffers
            "apart": all(u.master.untyped_storage().data_ptr()
                         != u.flat.untyped_storage().data_ptr() for u in engine.units),
            "kept": [u.kept is not None for u in units if u.params],
            "kept is master": [u.kept is u.master for u in units if u.params]}
    pairs = [("zero2", "optimizer", "bf16", "adamw", {}),
             ("zero3", "params", "bf16", "adamw", {}),
             ("zero3", "optimizer", "fp16", "sgd", {}),
             ("zero1", "optimizer", "fp32", "rmsprop", {}),
             ("zero2", "optimizer", "fp32", "sgd", {"staleness": 1}),
             ("zero1", "optimizer", "fp32", "sgd",
              {"compression": px.PowerSGD(rank=2, start_step=1)})]
    for strategy, offload, precision, opt_kind, options in pairs:  # against no offload
        key = (strategy, offload, precision, opt_kind, tuple(options))
        out[key] = [_run(strategy, choice, precision, opt_kind, **options)[2:]
                    for choice in (offload, None)]
    return out


def test_offloaded_training_equals_one_process_and_the_same_run_on_the_device():
    results = run_ranks(_parity_and_pairs, WORLD, timeout=400)
    want_state, want_optim = reference()
    for rank, got in enumerate(results):
        for strategy, offload in CASES:
            result, context = got[(strategy, offload)], f"{strategy} {offload} rank {rank}"
            for key, want in want_state.items():
                err = (result["state"][key] - want).abs().max().item()
                assert err <= RTOL * want.abs().max().item() + 1e-13, (context, key, err)
            assert_state_dicts_equal(result["optim"], want_optim, context)
            assert result["apart"], context
            report = result["report"]
            assert report["host_step_s"] > 0 and report["host_down_bytes"] > 0, report
            # zero3 keeps a compute-dtype shard for the gathers, the master itself where it is
            # one already (fp32 on the host); the others upload into their full buffer
            assert all(result["kept"]) == (strategy == "zero3"), context
            assert all(result["kept is master"]) == (offload == "params"), context
            up = report["host_up_bytes"]
            assert up > 0, context  # a step's uploads, or (params) the gathers' own
        for key, value in got.items():
            if len(key) != 5:
                continue
            (state, optim), (want, want_optim_) = value
            for name, tensor in want.items():
                err = (state[name] - tensor).abs().max().item()
                assert err <= 1e-13 * max(tensor.abs().max().item(), 1.0), (key, name, err)
            assert_state_dicts_equal(optim, want_optim_, str(key))


@pytest.mark.one_process
def test_the_host_step_uses_the_fused_cpu_kernels_and_leaves_the_groups_as_built():
    from phalanx.engine.offload import host_kernels

    p = torch.nn.Parameter(torch.zeros(3))
    adamw = torch.optim.AdamW([p], lr=0.1)
    explicit = torch.optim.AdamW([p], lr=0.1, foreach=False)
    rmsprop = torch.optim.RMSprop([p], lr=0.1)
    with host_kernels(adamw), host_kernels(explicit), host_kernels(rmsprop):
        assert adamw.param_groups[0]["fused"] is True
        assert not adamw.param_groups[0]["foreach"]
        assert explicit.param_groups[0]["foreach"] is False  # the user's choice stays
        assert not explicit.param_groups[0]["fused"]
        assert rmsprop.param_groups[0]["foreach"] is True
    assert adamw.param_groups[0]["fused"] is None and adamw.param_groups[0]["foreach"] is None
    assert rmsprop.param_groups[0]["foreach"] is None


@pytest.mark.one_process
@pytest.mark.parametrize("strategy,offload,why", [
    ("ddp", "optimizer", "ddp keeps the whole optimizer state on every rank"),
    ("zero2", "params", "only zero3 keeps shards of the parameters"),
    ("zero3", "gpu", "'optimizer'"),
    (px.DiLoCo(sync_every=4), "optimizer", "its inner optimizer is replicated")])
def test_what_offload_cannot_take_is_refused_by_name(strategy, offload, why):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=why):
        px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy,
                   offload=offload)


def _checkpoints(directory):
    out = {}
    for (saved, saved_offload), (loaded, loaded_offload) in (
            (("zero3", "params"), ("ddp", None)), (("ddp", None), ("zero2", "optimizer")),
            (("zero3", "optimizer"), ("zero3", None))):
        model, opt, state, optim = _run(saved, saved_offload)
        path = os.path.join(directory, f"{saved}-{saved_offload}")
        px.save(path, model=model, optimizer=opt)
        other = build(SEED + 5)
        other, other_opt = px.prepare(other, optimizer_for(other), strategy=loaded,
                                      bucket_mb=BUCKET_MB, offload=loaded_offload)
        px.load(path, model=other, optimizer=other_opt)
        out[(saved, loaded)] = (state, optim, {k: v.clone() for k, v in other.state_dict().items()},
                                copy.deepcopy(px.optimizer_state_dict(other_opt)))
        x, y = data(50, 2)  # the loaded model trains on
        loss_of(other, x, y).backward()
        other_opt.step()
    return out


def test_an_offloaded_checkpoint_loads_anywhere_and_the_other_way(tmp_path):
    for rank, got in enumerate(run_ranks(_checkpoints, WORLD, args=(str(tmp_path),),
                                         timeout=300)):
        for key, (state, optim, loaded, loaded_optim) in got.items():
            for name, value in state.items():
                assert torch.equal(loaded[name], value), (key, rank, name)
            assert_state_dicts_equal(loaded_optim, optim, f"{key} rank {rank}")


def _shard_groups():
    return [_run("zero2", choice, opt_kind="sgd", shard_size=2)[2:] for choice in
            ("optimizer", None)]


@pytest.mark.slow
def test_offload_with_shard_size_ends_where_the_device_run_ends():
    """shard_size=2 at 4 ranks: each group's shards averaged across the groups on the device,
    then stepped on the host."""
    for (state, optim), (want, want_optim) in run_ranks(_shard_groups, 4, timeout=300):
        for name, tensor in want.items():
            err = (state[name] - tensor).abs().max().item()
            assert err <= 1e-13 * max(tensor.abs().max().item(), 1.0), (name, err)
        assert_state_dicts_equal(optim, want_optim, "shard_size=2")


def _gradients_on_the_host(strategy):
    """After each backward: every reduced gradient shard is the unit's host copy and no device
    shard is kept; two backwards without no_sync add up on the host as on the device."""
    out = {}
    for offload in (None, "optimizer"):
        model = build(SEED + px.rank())
        opt = optimizer_for(model)
        model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=BUCKET_MB,
                                offload=offload)
        engine, kept = engine_of(model), []
        for step in range(2):
            for micro in range(2):  # no no_sync: the second backward adds to the first
                x, y = data(step * 2 + micro, 2 * WORLD)
                loss_of(model, x[2 * px.rank():2 * px.rank() + 2],
                        y[2 * px.rank():2 * px.rank() + 2]).backward()
            kept.append([(u.reduced is u.host_grad, u.grad_shard is None)
                         for u in engine.units if u.reduced is not None])
            opt.step()
            opt.zero_grad()
        out[offload] = (model.state_dict(), kept)
    return out


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_gradient_shards_go_to_the_host_as_they_are_made(strategy):
    for got in run_ranks(_gradients_on_the_host, WORLD, args=(strategy,), timeout=180):
        on_device, offloaded = got[None], got["optimizer"]
        assert all(offloaded[1])  # some unit had a reduced gradient at every step
        assert all(flags == (True, True) for step in offloaded[1] for flags in step)
        assert all(flags == (False, False) for step in on_device[1] for flags in step)
        for name, value in on_device[0].items():
            assert torch.allclose(offloaded[0][name], value, rtol=1e-12, atol=0), name
