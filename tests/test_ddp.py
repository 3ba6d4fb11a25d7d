"""strategy="ddp": N ranks with batch b train exactly like one process with batch N*b."""

import pytest
import torch
import torch.distributed as dist
from parity import assert_params_close, make_data, make_model, tolerance, train

import phalanx as px
from phalanx.testing import RanksFailed, run_ranks

COMBOS = [(model, opt, accum)
          for model in ("mlp", "transformer", "branchy")
          for opt in ("sgd", "adamw")
          for accum in (1, 2)]
B = 3


def _train_all(world, combos, prepare_kwargs):
    return {combo: train(*combo[:2], world=world, b=B, accum=combo[2],
                         prepare_kwargs=prepare_kwargs) for combo in combos}


@pytest.fixture(scope="module")
def references():
    return {}


def _reference(references, combo, world):
    key = combo + (world,)
    if key not in references:
        references[key] = train(combo[0], combo[1], world=world, b=B, accum=combo[2])
    return references[key]


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_ddp_matches_one_process(world, references):
    results = run_ranks(_train_all, world, args=(world, COMBOS, {"strategy": "ddp"}), timeout=180)
    for combo in COMBOS:
        want = _reference(references, combo, world)
        for rank, got in enumerate(results):
            assert_params_close(got[combo], want,
                                rtol=tolerance(*combo[:2], world, B, accum=combo[2]),
                                context=f"{combo} world {world} rank {rank}")


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_with_sync_batchnorm_matches_one_process(world):
    combos = [("cnn", "sgd", 1), ("cnn", "adamw", 2)]
    results = run_ranks(_train_all, world,
                        args=(world, combos, {"strategy": "ddp", "sync_batchnorm": True}),
                        timeout=180)
    for combo in combos:
        want = train(combo[0], combo[1], world=world, b=B, accum=combo[2])
        for rank, got in enumerate(results):
            assert_params_close(got[combo], want,
                                rtol=tolerance(*combo[:2], world, B, accum=combo[2]),
                                context=f"{combo} world {world} rank {rank}")


def test_without_sync_batchnorm_the_cnn_differs():
    """The sync_batchnorm test can fail: per-rank statistics give another model."""
    combo = ("cnn", "sgd", 1)
    got = run_ranks(_train_all, 2, args=(2, [combo], {"strategy": "ddp"}), timeout=120)[0][combo]
    want = train("cnn", "sgd", world=2, b=B)
    with pytest.raises(AssertionError):
        assert_params_close(got, want, rtol=tolerance("cnn", "sgd", 2, B))


@pytest.mark.one_process
def test_a_naive_per_rank_mean_would_fail_the_parity_check():
    """Guard against a vacuous reference: training without averaging is detectably different."""
    want = train("mlp", "sgd", world=2, b=B)
    alone = train("mlp", "sgd", world=1, b=B)
    with pytest.raises(AssertionError):
        assert_params_close(alone, want, rtol=tolerance("mlp", "sgd", 2, B))


def _bucketed_vs_naive(bucket_mb, comm_dtype):
    """Gradients from the bucketed path against one all-reduce per parameter."""
    model = make_model("transformer")
    reference = make_model("transformer")
    model, _ = px.prepare(model, None, strategy="ddp", bucket_mb=bucket_mb, comm_dtype=comm_dtype)
    results = []
    for step in range(3):  # step 0 runs with the initial buckets, later steps with rebuilt ones
        x, y = make_data("transformer", 2 * px.world_size(), step)
        mine = slice(2 * px.rank(), 2 * px.rank() + 2)
        for m in (model, reference):
            out = m(x[mine])["logits"]
            torch.nn.functional.cross_entropy(out.reshape(-1, 20), y[mine].reshape(-1)).backward()
        for p in reference.parameters():  # the naive reference: one all-reduce per parameter
            dist.all_reduce(p.grad)
            p.grad /= px.world_size()
        got = [p.grad.clone() for p in px.unwrap(model).parameters()]
        want = [p.grad.clone() for p in reference.parameters()]
        # every gradient is a view into its bucket: as many storages as buckets, fewer than
        # parameters, and no second copy of the gradients
        params = list(px.unwrap(model).parameters())
        storages = {p.grad.untyped_storage().data_ptr() for p in params}
        views = len(storages) < len(params)
        results.append((got, want, views, len(storages)))
        for m in (px.unwrap(model), reference):
            m.zero_grad()
    return results


@pytest.mark.parametrize("bucket_mb,comm_dtype",
                         [(25, None), (0.001, None), (0.001, torch.bfloat16)])
def test_bucketed_gradients_equal_naive_per_parameter_all_reduce(bucket_mb, comm_dtype):
    results = run_ranks(_bucketed_vs_naive, 3, args=(bucket_mb, comm_dtype), timeout=120)
    for rank_results in results:
        for got, want, views, n_buckets in rank_results:
            assert views
            if bucket_mb < 0.01:
                assert n_buckets > 3  # tiny cap: many buckets, launched in order
            for a, b in zip(got, want):
                if comm_dtype is None:
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
                else:  # bf16 on the wire: equal to bf16 precision
                    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def _unused_everywhere_keeps_grad_none():
    model = make_model("branchy")
    model, _ = px.prepare(model, None)
    x, y = make_data("branchy", 4, 0)
    out, _ = model(x, branch=px.rank() % 2)
    out.sum().backward()
    m = px.unwrap(model)
    return (m.never_used.weight.grad is None, m.frozen.weight.grad is None,
            m.left.weight.grad is not None, m.right.weight.grad is not None)


def test_parameters_unused_on_every_rank_keep_no_gradient():
    for flags in run_ranks(_unused_everywhere_keeps_grad_none, 2, timeout=60):
        assert flags == (True, True, True, True)


def _mismatched_model():
    width = 8 if px.rank() != 2 else 9
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, width))
    px.prepare(model, None)


def test_a_model_that_differs_between_ranks_is_named_on_every_rank():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_mismatched_model, 3, timeout=60)
    text = str(info.value)
    assert "3 of 3 ranks failed" in text
    assert "'1.weight'" in text and "rank 2" in text and "[9, 4]" in text


def _bad_name(kwargs):
    px.prepare(torch.nn.Linear(2, 2), None, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"strategy": "zer01"}, "unknown strategy 'zer01'"),
    ({"precision": "fp8"}, "unknown precision 'fp8'"),
    ({"bucket_mb": 0}, "bucket_mb"),
])
def test_bad_options_fail_on_every_rank(kwargs, match):
    with pytest.raises(RanksFailed) as info:
        run_ranks(_bad_name, 2, args=(kwargs,), timeout=60)
    assert "2 of 2 ranks failed" in str(info.value)
    assert match in str(info.value)


@pytest.mark.one_process
def test_world_of_one_needs_no_process_group():
    model = make_model("mlp")
    prepared, _ = px.prepare(model, None)
    assert px.unwrap(prepared) is model
    x, y = make_data("mlp", 4, 0)
    torch.nn.functional.mse_loss(prepared(x), y).backward()
    # no buckets, no hooks: every gradient is autograd's own tensor, as without phalanx
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters()))
    assert all(p.grad is not None for p in model.parameters())
    assert prepared.state_dict().keys() == model.state_dict().keys()
