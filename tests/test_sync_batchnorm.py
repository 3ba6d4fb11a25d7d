"""SyncBatchNorm: N ranks, each with its slice of the batch, train as one process on the whole
batch.

The reference is always a plain, unconverted model run in this process on the concatenated
batch. Conventions, as under data parallelism: rank r's loss is scaled so that the MEAN of the
ranks' losses is the reference loss; then the mean of the ranks' parameter gradients equals the
reference gradient, and rank r's input gradient is N times the reference's (each rank's backward
differentiates the SUM of the ranks' losses, which is what makes the averaged gradients right).

The conversion itself, with no process group: test_sync_batchnorm_conversion.py.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import phalanx as px
from phalanx.comm.collectives import Comm
from phalanx.model.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from phalanx.testing import RanksFailed, run_ranks

STEPS = 3
LR = 0.1


def _model(kind, dtype):
    torch.manual_seed(0)
    # No bias right before a BatchNorm: its gradient is zero up to round-off, nothing to compare.
    if kind == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 4, 3, stride=2, bias=False), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
            nn.Flatten(), nn.Linear(16, 3))
    else:
        model = nn.Sequential(
            nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(),
            nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8, affine=False), nn.Linear(8, 3))
    for m in model.modules():  # BatchNorm starts at weight 1, bias 0: make them matter
        if isinstance(m, _BatchNorm) and m.affine:
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.normal_(m.bias)
    return model.to(dtype)


def _batch(kind, step, total, dtype):
    g = torch.Generator().manual_seed(100 + step)
    shape = (total, 3, 6, 6) if kind == "cnn" else (total, 6)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5
    target = torch.randn(total, 3, generator=g, dtype=torch.float64)
    return x.to(dtype), target.to(dtype)


def _loss(out, target, scale):
    return ((out - target) ** 2).sum() * scale


def _rank_slice(sizes):
    start = sum(sizes[:px.rank()])
    return slice(start, start + sizes[px.rank()])


def _collectives(model):
    """How many of each synchronized BatchNorm collective the model's layers have recorded."""
    counts = {"gather": 0, "reduce": 0}
    tags = {"sync_batchnorm:stats": "gather", "sync_batchnorm:grads": "reduce"}
    for m in model.modules():
        if isinstance(m, SyncBatchNorm) and m.comm is not None:
            for record in m.comm.records:
                counts[tags[record.tag]] += 1
    return counts


def _forbidden(*_args, **_kwargs):
    raise AssertionError("eval mode must not communicate")


def _train_on_ranks(kind, sizes, dtype, convert):
    """Each rank trains on its slice; returns what it saw at every step and its final state."""
    world, total = px.world_size(), sum(sizes)
    model = _model(kind, dtype)
    if convert:
        model = convert_sync_batchnorm(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        x, target = _batch(kind, step, total, dtype)
        x, target = x[_rank_slice(sizes)].requires_grad_(), target[_rank_slice(sizes)]
        out = model(x)
        _loss(out, target, world / total).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():  # the averaging that data parallelism does
            if world > 1:
                dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        steps.append((out.detach(), x.grad, grads))
    collectives = _collectives(model)
    model.eval()
    for name in ("all_gather_into", "all_gather_list", "all_reduce", "broadcast"):
        setattr(Comm, name, _forbidden)
    x, _ = _batch(kind, STEPS, total, dtype)
    with torch.no_grad():
        eval_out = model(x[_rank_slice(sizes)])
    return steps, model.state_dict(), eval_out, collectives


def _reference(kind, sizes, dtype):
    total = sum(sizes)
    model = _model(kind, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        x, target = _batch(kind, step, total, dtype)
        x.requires_grad_()
        out = model(x)
        _loss(out, target, 1 / total).backward()
        steps.append((out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    model.eval()
    x, _ = _batch(kind, STEPS, total, dtype)
    with torch.no_grad():
        eval_out = model(x)
    return steps, model.state_dict(), eval_out


def _assert_close(actual, expected, rtol, what):
    """Equal within `rtol` of the largest magnitude in `expected` (a norm-wise relative test)."""
    assert actual.shape == expected.shape, what
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = expected.double().abs().max().item() if expected.numel() else 1.0
    assert err <= rtol * scale + 1e-30, f"{what}: max error {err:.3g}, scale {scale:.3g}"


CASES = [  # (model, per-rank batch sizes, dtype)
    ("cnn", [8], torch.float32),
    ("cnn", [4, 4], torch.float32),
    ("cnn", [3, 3, 3], torch.float32),
    ("mlp", [6, 6, 6], torch.float32),
    ("cnn", [4, 4], torch.float64),
    ("cnn", [5, 2, 1], torch.float64),  # uneven: the last batch of an epoch
    ("mlp", [7, 1], torch.float32),
    ("mlp", [4, 0, 3], torch.float64),  # a rank with no samples at all
]


@pytest.mark.parametrize("kind,sizes,dtype", CASES,
                         ids=[f"{k}-{'+'.join(map(str, s))}-{str(d)[6:]}" for k, s, d in CASES])
def test_ranks_train_exactly_like_one_process_on_the_whole_batch(kind, sizes, dtype):
    world = len(sizes)
    results = run_ranks(_train_on_ranks, world, args=(kind, sizes, dtype, True), timeout=60)
    ref_steps, ref_state, ref_eval = _reference(kind, sizes, dtype)
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    for step, (ref_out, ref_dx, ref_grads) in enumerate(ref_steps):
        outs, dxs, grads = zip(*(r[0][step] for r in results))
        _assert_close(torch.cat(outs), ref_out, rtol, f"step {step} output")
        _assert_close(torch.cat(dxs) / world, ref_dx, rtol, f"step {step} input grad")
        for i, ref_grad in enumerate(ref_grads):
            mean_grad = torch.stack([g[i] for g in grads]).mean(0)
            _assert_close(mean_grad, ref_grad, rtol, f"step {step} grad of parameter {i}")
    for rank, (_, state, _, collectives) in enumerate(results):
        assert state.keys() == ref_state.keys()
        for name, ref_value in ref_state.items():
            if name.endswith("num_batches_tracked"):
                assert state[name].item() == ref_value.item() == STEPS, name
            else:
                _assert_close(state[name], ref_value, rtol, f"rank {rank} {name}")
        n_bn = 2
        # [Note: one collective each way]: one gather per layer forward, one reduce per backward.
        expected = {"gather": STEPS * n_bn, "reduce": STEPS * n_bn} if world > 1 else \
            {"gather": 0, "reduce": 0}
        assert collectives == expected
    _assert_close(torch.cat([r[2] for r in results]), ref_eval, rtol, "eval output")


def test_without_conversion_the_ranks_do_not_match_one_process():
    """The parity test above can fail: ordinary BatchNorm on 2 ranks differs from the reference."""
    sizes = [4, 4]
    results = run_ranks(_train_on_ranks, 2, args=("cnn", sizes, torch.float64, False), timeout=60)
    ref_steps, ref_state, _ = _reference("cnn", sizes, torch.float64)
    with pytest.raises(AssertionError):
        _assert_close(torch.cat([r[0][0][0] for r in results]), ref_steps[0][0], 1e-3, "output")
    with pytest.raises(AssertionError):
        _assert_close(results[0][1]["1.running_var"], ref_state["1.running_var"], 1e-3, "var")


# Single layers on every input rank, and the options of BatchNorm, at two ranks with uneven batches.
LAYERS = [  # (constructor, keyword arguments, per-sample shape)
    (nn.BatchNorm1d, {}, (5,)),
    (nn.BatchNorm1d, {"momentum": None}, (5, 7)),
    (nn.BatchNorm2d, {}, (3, 4, 5)),
    (nn.BatchNorm2d, {"affine": False}, (3, 4, 5)),
    (nn.BatchNorm2d, {"track_running_stats": False}, (3, 2, 2)),
    (nn.BatchNorm3d, {"eps": 1e-3}, (2, 3, 4, 3)),
]
LAYER_SIZES = [3, 2]


def _layer_batch(shape, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(sum(LAYER_SIZES), *shape, generator=g, dtype=torch.float64) * 3 - 1
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def _new_layer(ctor, kwargs, shape):
    layer = ctor(shape[0], **kwargs).double()
    if layer.affine:
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(0.5, 1.5, shape[0]))
            layer.bias.copy_(torch.linspace(-1, 1, shape[0]))
    return layer


def _layers_on_ranks():
    world, total = px.world_size(), sum(LAYER_SIZES)
    results = []
    for ctor, kwargs, shape in LAYERS:
        layer = convert_sync_batchnorm(_new_layer(ctor, kwargs, shape))
        seen = []
        for step in range(2):
            x, w = _layer_batch(shape, step)
            x, w = x[_rank_slice(LAYER_SIZES)].requires_grad_(), w[_rank_slice(LAYER_SIZES)]
            y = layer(x)
            (y * w).sum().mul(world / total).backward()
            grads = [p.grad.clone() for p in layer.parameters()]
            layer.zero_grad()
            seen.append((y.detach(), x.grad, grads))
        results.append((seen, layer.state_dict()))
    return results


def test_every_input_rank_and_option_of_batchnorm():
    results = run_ranks(_layers_on_ranks, 2, timeout=60)
    total = sum(LAYER_SIZES)
    for i, (ctor, kwargs, shape) in enumerate(LAYERS):
        what = f"{ctor.__name__}({kwargs}) on {shape}"
        ref = _new_layer(ctor, kwargs, shape)
        for step in range(2):
            x, w = _layer_batch(shape, step)
            x.requires_grad_()
            y = ref(x)
            (y * w).sum().div(total).backward()
            seen = [r[i][0][step] for r in results]
            _assert_close(torch.cat([s[0] for s in seen]), y, 1e-12, f"{what} output")
            _assert_close(torch.cat([s[1] for s in seen]) / 2, x.grad, 1e-12, f"{what} dx")
            for j, p in enumerate(ref.parameters()):
                mean_grad = (seen[0][2][j] + seen[1][2][j]) / 2
                _assert_close(mean_grad, p.grad, 1e-12, f"{what} grad {j}")
            ref.zero_grad()
        for rank in range(2):
            state = results[rank][i][1]
            assert state.keys() == ref.state_dict().keys(), what
            for name, value in ref.state_dict().items():
                _assert_close(state[name], value, 1e-12, f"{what} {name}")


def _two_groups():
    pair, single = dist.new_group([0, 1]), dist.new_group([2])
    group = pair if px.rank() < 2 else single
    layer = convert_sync_batchnorm(_new_layer(nn.BatchNorm2d, {}, (3, 2, 2)), group=group)
    x, w = _layer_batch((3, 2, 2), 0)
    x = x[px.rank() * 2:px.rank() * 2 + 2].requires_grad_()
    y = layer(x)
    (y * w[px.rank() * 2:px.rank() * 2 + 2]).sum().backward()
    return y.detach(), x.grad, layer.running_var


def test_an_explicit_group_synchronizes_only_its_ranks():
    """Ranks 0 and 1 share a group; rank 2 is a group of one and normalises alone."""
    results = run_ranks(_two_groups, 3, timeout=60)
    x, w = _layer_batch((3, 2, 2), 0)
    for ranks in ([0, 1], [2]):
        ref = _new_layer(nn.BatchNorm2d, {}, (3, 2, 2))
        xs = x[ranks[0] * 2:ranks[-1] * 2 + 2].clone().requires_grad_()
        y = ref(xs)
        (y * w[ranks[0] * 2:ranks[-1] * 2 + 2]).sum().backward()
        _assert_close(torch.cat([results[r][0] for r in ranks]), y, 1e-12, f"{ranks} output")
        _assert_close(torch.cat([results[r][1] for r in ranks]), xs.grad, 1e-12, f"{ranks} dx")
        for r in ranks:
            _assert_close(results[r][2], ref.running_var, 1e-12, f"{ranks} running_var")


def _offset_and_low_precision():
    out = {}
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4096, 4, generator=g, dtype=torch.float64) + 1000  # |mean| >> std
    layer = convert_sync_batchnorm(nn.BatchNorm1d(4, momentum=1.0))
    out["offset"] = layer(x[px.rank()].float()).detach(), layer.running_var.clone()
    x = torch.randn(2, 64, 3, 5, 5, generator=g) * 4 + 2
    w = torch.randn(2, 64, 3, 5, 5, generator=g)
    layer = convert_sync_batchnorm(nn.BatchNorm2d(3, momentum=1.0))
    xb = x[px.rank()].bfloat16().requires_grad_()
    y = layer(xb)
    (y.float() * w[px.rank()]).sum().backward()
    out["bf16"] = y.detach(), xb.grad, layer.running_mean.clone(), layer.running_var.clone()
    return out


def test_precision_large_offsets_and_bf16_inputs():
    results = run_ranks(_offset_and_low_precision, 2, timeout=60)
    # Mean 1000, std 1: the combined per-rank moments stay exact in fp32 ...
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4096, 4, generator=g, dtype=torch.float64) + 1000
    flat = x.reshape(-1, 4)
    true_var = flat.var(0)
    ref = nn.BatchNorm1d(4).double()(flat)
    _assert_close(torch.cat([r["offset"][0] for r in results]), ref, 1e-4, "offset output")
    for r in results:
        _assert_close(r["offset"][1], true_var, 1e-4, "offset running_var")
    # ... where E[x^2] - E[x]^2 from fp32 sums, the one-all-reduce alternative, is far off.
    xf = flat.float()
    naive = (xf * xf).mean(0) - xf.mean(0) ** 2
    assert ((naive.double() - true_var).abs() / true_var).max() > 0.05

    # bf16 inputs: statistics in fp32, outputs and input grads in bf16.
    x = torch.randn(2, 64, 3, 5, 5, generator=g) * 4 + 2
    w = torch.randn(2, 64, 3, 5, 5, generator=g)
    xb = x.bfloat16().float().reshape(128, 3, 5, 5).requires_grad_()
    ref_layer = nn.BatchNorm2d(3, momentum=1.0)
    y = ref_layer(xb)
    (y * w.reshape(128, 3, 5, 5)).sum().backward()  # the sum of the two ranks' losses
    ys, dxs, means, variances = zip(*(r["bf16"] for r in results))
    assert ys[0].dtype == dxs[0].dtype == torch.bfloat16
    _assert_close(torch.cat(ys).float(), y, 1e-2, "bf16 output")
    _assert_close(torch.cat(dxs).float(), xb.grad, 2e-2, "bf16 input grad")
    for mean, var in zip(means, variances):
        _assert_close(mean, ref_layer.running_mean, 1e-5, "bf16 running_mean")
        _assert_close(var, ref_layer.running_var, 1e-5, "bf16 running_var")


def _one_value_per_channel():
    layer = convert_sync_batchnorm(nn.BatchNorm1d(3))
    layer(torch.randn(1 - px.rank(), 3))  # one sample on rank 0, none on rank 1


def test_one_value_per_channel_fails_on_every_rank():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_one_value_per_channel, 2, timeout=30)
    message = str(info.value)
    assert "2 of 2 ranks failed" in message
    assert message.count("Expected more than 1 value per channel") >= 2
