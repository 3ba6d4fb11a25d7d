"""DiLoCo (`strategy=px.DiLoCo(...)`): real ranks on gloo, float64, against a one-process
simulation of the same algorithm and against ddp; its sign, its checkpoints, its report."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import run_ranks

GLOBAL = 12  # rows per step, divisible by 1, 2, 3 and 4 ranks
TIMEOUT = 90


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _model():
    torch.manual_seed(7)
    return Net().double()


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(GLOBAL, 6, generator=g, dtype=torch.float64),
            torch.randn(GLOBAL, 3, generator=g, dtype=torch.float64))


def _inner(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def _local_step(model, opt, step, rank, world, accum=1, clip=None, no_sync=None):
    """One inner step on this rank's rows, in `accum` micro-steps (all but the last under
    `no_sync`, when given), clipped by this rank's norm."""
    x, y = _batch(step)
    rows = GLOBAL // world
    x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    micro = rows // accum
    for a in range(accum):
        context = no_sync() if no_sync is not None and a < accum - 1 else _Nothing()
        with context:
            loss = F.mse_loss(model(x[a * micro:(a + 1) * micro]), y[a * micro:(a + 1) * micro])
            (loss / accum).backward()
    if clip is not None:
        if no_sync is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        else:
            px.clip_grad_norm_(model, clip)
    opt.step()
    opt.zero_grad()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _simulate(world, steps, H, kind, lr, momentum, nesterov=True, accum=1, clip=None):
    """One process playing `world` workers: each its own copy and inner optimizer, and every H
    steps the outer Nesterov SGD on the mean of (synced - weights), written out by hand."""
    base = _model()
    workers = [copy.deepcopy(base) for _ in range(world)]
    opts = [_inner(kind, w) for w in workers]
    synced = [p.detach().clone() for p in base.parameters()]
    velocity = [torch.zeros_like(s) for s in synced]
    for step in range(steps):
        for r in range(world):
            _local_step(workers[r], opts[r], step, r, world, accum, clip)
        if (step + 1) % H:
            continue
        with torch.no_grad():
            for i, s in enumerate(synced):
                delta = sum(s - list(w.parameters())[i] for w in workers) / world
                velocity[i] = momentum * velocity[i] + delta
                update = delta + momentum * velocity[i] if nesterov and momentum else velocity[i]
                s -= lr * update
            for w in workers:
                for p, s in zip(w.parameters(), synced):
                    p.copy_(s)
    return [[p.detach().clone() for p in w.parameters()] for w in workers]


def _rank_run(steps, H, kind, lr, momentum, accum=1, clip=None, comm_dtype=None):
    world, rank = px.world_size(), px.rank()
    model = _model()
    opt = _inner(kind, model)
    model, opt = px.prepare(model, opt, strategy=px.DiLoCo(
        sync_every=H, outer_lr=lr, outer_momentum=momentum, comm_dtype=comm_dtype))
    for step in range(steps):
        _local_step(model, opt, step, rank, world, accum, clip,
                    no_sync=(lambda: px.no_sync(model)))
    return [p.detach().clone() for p in px.unwrap(model).parameters()]


def _assert_close(got, want, context):
    for i, (a, b) in enumerate(zip(got, want)):
        err = (a - b).abs().max().item()
        assert err <= 1e-12 * max(b.abs().max().item(), 1.0), f"{context}: param {i} off by {err}"


@pytest.mark.parametrize("world,accum,clip", [(2, 2, 0.05), (4, 1, None)])
def test_diloco_equals_a_one_process_simulation_of_its_workers(world, accum, clip):
    """H=3, AdamW inner, outer Nesterov 0.7/0.9; 7 steps: two syncs and one step past. With 2
    ranks, 2 micro-steps under px.no_sync and px.clip_grad_norm_ clipping by each rank's own
    norm (small enough to clip)."""
    want = _simulate(world, 7, 3, "adamw", 0.7, 0.9, accum=accum, clip=clip)
    got = run_ranks(_rank_run, world, args=(7, 3, "adamw", 0.7, 0.9, accum, clip),
                    timeout=TIMEOUT)
    for rank in range(world):
        _assert_close(got[rank], want[rank], f"rank {rank}")
    assert not all(torch.equal(a, b) for a, b in zip(got[0], got[1])), \
        "a step past the sync, the ranks' weights should differ"


def _against_ddp():
    rank, world = px.rank(), px.world_size()
    out = []
    for strategy in ("ddp", px.DiLoCo(sync_every=1, outer_lr=1.0, outer_momentum=0.0)):
        model = _model()
        opt = _inner("sgd", model)
        model, opt = px.prepare(model, opt, strategy=strategy)
        for step in range(4):
            _local_step(model, opt, step, rank, world)
        out.append([p.detach().clone() for p in px.unwrap(model).parameters()])
    return out


def test_sync_every_step_with_plain_outer_sgd_equals_ddp():
    for ddp, diloco in run_ranks(_against_ddp, 2, timeout=TIMEOUT):
        _assert_close(diloco, ddp, "DiLoCo(1, outer_lr=1, outer_momentum=0) against ddp")


def _descent(lr, momentum, comm_dtype, precision):
    """A convex least-squares problem: the global loss at the synced weights before and after
    one outer step, each rank's parameters after it, and the step's report."""
    rank, world = px.rank(), px.world_size()
    torch.manual_seed(0)
    model = nn.Linear(6, 3).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = px.prepare(model, opt, precision=precision, strategy=px.DiLoCo(
        sync_every=4, outer_lr=lr, outer_momentum=momentum, comm_dtype=comm_dtype))
    x, y = _batch(0)

    def global_loss():
        with torch.no_grad():
            return F.mse_loss(model(x), y).item()
    before = global_loss()
    reports = []
    rows = GLOBAL // world
    for _ in range(4):  # the same rows each step: the convex problem of this rank's rows
        F.mse_loss(model(x[rank * rows:(rank + 1) * rows]),
                   y[rank * rows:(rank + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()
        reports.append(px.step_stats(model))
    params = [p.detach().clone() for p in px.unwrap(model).parameters()]
    return before, global_loss(), params, reports


@pytest.mark.parametrize("lr,momentum,comm_dtype,precision", [
    (0.7, 0.9, None, "fp32"), (1.0, 0.0, "bf16", "fp32"), (0.7, 0.9, None, "bf16")])
def test_one_outer_step_descends_and_every_rank_holds_the_same_weights(lr, momentum,
                                                                        comm_dtype, precision):
    """The sign test (a pseudo-gradient of now - synced would step uphill), and the step report:
    inner steps send nothing, the sync one all-reduce of every parameter in the comm dtype (the
    float64 masters' under bf16 compute)."""
    results = run_ranks(_descent, 2, args=(lr, momentum, comm_dtype, precision),
                        timeout=TIMEOUT)
    before, after, params, reports = results[0]
    assert after < 0.9 * before, (before, after)
    for _, _, other, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, other))
    numel = sum(p.numel() for p in params)
    for report in reports[:3]:
        assert report["comm_bytes"] == 0 and "all_reduce/count" not in report
    assert reports[3]["all_reduce/count"] == 1
    assert reports[3]["all_reduce/bytes"] == numel * (2 if comm_dtype else 8)


def _first_part(path, H, kind, momentum, steps, export=None):
    rank, world = px.rank(), px.world_size()
    model = _model()
    opt = _inner(kind, model)
    model, opt = px.prepare(model, opt, strategy=px.DiLoCo(sync_every=H, outer_momentum=momentum))
    for step in range(steps):
        _local_step(model, opt, step, rank, world)
    px.save(path, model=model, optimizer=opt)
    if export is not None:
        px.export(export, model)
    return [p.detach().clone() for p in px.unwrap(model).parameters()]


def _second_part(path, H, kind, momentum, first, steps):
    rank, world = px.rank(), px.world_size()
    model = _model()
    opt = _inner(kind, model)
    model, opt = px.prepare(model, opt, strategy=px.DiLoCo(sync_every=H, outer_momentum=momentum))
    loaded = None
    if path is not None:
        px.load(path, model=model, optimizer=opt)
        loaded = [p.detach().clone() for p in px.unwrap(model).parameters()]
        first_step = first
    else:
        first_step = 0
    for step in range(first_step, first + steps):
        _local_step(model, opt, step, rank, world)
    return loaded, [p.detach().clone() for p in px.unwrap(model).parameters()]


def test_a_save_mid_interval_resumes_exactly_at_the_same_world_size(tmp_path):
    """AdamW inner, H=3, saved 2 steps after a sync: each rank takes back its own weights,
    inner state and count, and the outer momentum (torchft lost it: its PR #238)."""
    path = str(tmp_path / "ckpt")
    run_ranks(_first_part, 2, args=(path, 3, "adamw", 0.9, 5), timeout=TIMEOUT)
    resumed = run_ranks(_second_part, 2, args=(path, 3, "adamw", 0.9, 5, 4), timeout=TIMEOUT)
    straight = run_ranks(_second_part, 2, args=(None, 3, "adamw", 0.9, 5, 4), timeout=TIMEOUT)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(resumed[rank][1], straight[rank][1])), rank


def test_a_checkpoint_resumes_at_another_world_size(tmp_path):
    """sync_every=1 with inner SGD does not depend on the world size: saved on 2 ranks after 3
    steps and resumed on 3 and on 1, it equals 2 ranks uninterrupted (the outer momentum
    included). Saved mid-interval (H=3, 4 steps), 3 ranks resume from the last sync."""
    path = str(tmp_path / "ckpt")
    run_ranks(_first_part, 2, args=(path, 1, "sgd", 0.9, 3), timeout=TIMEOUT)
    straight = run_ranks(_second_part, 2, args=(None, 1, "sgd", 0.9, 3, 3), timeout=TIMEOUT)[0]
    for world in (3, 1):
        resumed = run_ranks(_second_part, world, args=(path, 1, "sgd", 0.9, 3, 3),
                            timeout=TIMEOUT)
        for _, params in resumed:
            _assert_close(params, straight[1], f"resumed on {world} ranks")
    mid = str(tmp_path / "mid")
    exported = str(tmp_path / "synced.safetensors")
    at_save = run_ranks(_first_part, 2, args=(mid, 3, "sgd", 0.9, 4, exported), timeout=TIMEOUT)
    synced = _simulate(2, 3, 3, "sgd", 0.7, 0.9)[0]  # the weights of the sync after step 3
    assert not all(torch.equal(a, b) for a, b in zip(at_save[0], synced))
    from safetensors.torch import load_file
    weights = load_file(exported)
    _assert_close([weights[n] for n, _ in _model().named_parameters()], synced, "px.export")
    results = run_ranks(_load_elsewhere, 3, args=(mid,), timeout=TIMEOUT)
    for loaded, _ in results:
        _assert_close(loaded, synced, "resumed from the last sync")
    caught = results[0][1]  # rank 0 warns
    assert any("saved 1 inner step(s) after a sync" in m for m in caught), caught


def _load_elsewhere(path):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, _ = _second_part(path, 3, "sgd", 0.9, 4, 0)
    return loaded, [str(w.message) for w in caught]


def _bad(case):
    model = _model()
    opt = _inner("sgd", model)
    try:
        if case == "class":
            px.prepare(model, opt, strategy=px.DiLoCo)
        elif case == "string":
            px.prepare(model, opt, strategy="diloco")
        elif case == "no optimizer":
            px.prepare(model, None, strategy=px.DiLoCo(sync_every=2))
        elif case == "comm_dtype":
            px.prepare(model, opt, strategy=px.DiLoCo(sync_every=2), comm_dtype=torch.bfloat16)
        elif case == "sync_batchnorm":
            px.prepare(model, opt, strategy=px.DiLoCo(sync_every=2), sync_batchnorm=True)
        elif case == "check_replicas_every":
            px.prepare(model, opt, strategy=px.DiLoCo(sync_every=2), check_replicas_every=5)
        elif case == "config":
            px.DiLoCo(sync_every=0)
        elif case == "staleness":
            px.prepare(model, opt, strategy=px.DiLoCo(sync_every=2), staleness=1)
        elif case == "shard_size":
            px.prepare(model, opt, strategy=px.DiLoCo(sync_every=2), shard_size=2)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.one_process
@pytest.mark.parametrize("kwargs,match", [
    ({"sync_every": 0}, "sync_every=0"), ({"sync_every": 2.5}, "whole number"),
    ({"sync_every": 2, "outer_lr": -1}, "outer_lr"), ({"sync_every": 2, "outer_momentum": 1.0},
                                                      "below 1"),
    ({"sync_every": 2, "comm_dtype": torch.int16}, "comm_dtype")])
def test_bad_configurations_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        px.DiLoCo(**kwargs)


def test_bad_options_raise_on_every_rank_before_any_collective():
    cases = ["class", "string", "no optimizer", "comm_dtype", "sync_batchnorm",
             "check_replicas_every", "config", "staleness", "shard_size"]
    for case, want in zip(cases, ["an instance", "needs its interval", "needs the optimizer",
                                  "DiLoCo never sends", "every forward", "lets differ",
                                  "sync_every=0", "not both", "leave shard_size out"]):
        messages = run_ranks(_bad, 2, args=(case,), timeout=TIMEOUT)
        assert all(m is not None and want in m for m in messages), (case, messages)


def _buffers_and_nan():
    """BatchNorm buffers just before and after a sync; then a NaN loss on rank 1 alone under
    on_nonfinite='skip'."""
    rank, world = px.rank(), px.world_size()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy=px.DiLoCo(sync_every=2), on_nonfinite="skip")
    bn = px.unwrap(model)[1]
    x, y = _batch(0)
    rows = GLOBAL // world
    mine = slice(rank * rows, (rank + 1) * rows)
    before = None
    for step in range(2):
        F.mse_loss(model(x[mine] * (1 + step + rank)), y[mine]).backward()
        if step == 1:
            before = (bn.running_mean.clone(), bn.running_var.clone())
        opt.step()
        opt.zero_grad()
    after = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    start = [p.detach().clone() for p in model.parameters()]
    loss = F.mse_loss(model(x[mine]), y[mine])
    if rank == 1:
        loss = loss * float("nan")
    loss.backward()
    opt.step()  # an inner step: rank 1 skips it on its own, rank 0 steps, nobody waits
    opt.zero_grad()
    changed = any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))
    return before, after, changed


def test_buffers_are_averaged_at_a_sync_and_a_nan_on_one_rank_is_that_ranks_alone():
    results = run_ranks(_buffers_and_nan, 2, timeout=TIMEOUT)
    (b0, a0, changed0), (b1, a1, changed1) = results
    assert not torch.equal(b0[0], b1[0])  # each rank's own statistics before the sync
    for i in range(2):
        assert torch.allclose(a0[i], (b0[i] + b1[i]) / 2, rtol=0, atol=1e-15)
        assert torch.equal(a0[i], a1[i])
    assert a0[2] == a1[2] == 2
    assert changed0 and not changed1
