"""Evaluation and inference on real processes: gather_for_metrics returns the whole dataset
once, map_batches returns every result in order, and bad input fails on every rank."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import phalanx as px
from phalanx.testing import run_ranks

LENGTHS = (1, 7, 10, 64)


class Samples(Dataset):
    """Sample i: a feature row, a label and a name, so outputs can be checked per sample."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i), 2.0 * i]), "label": i % 3, "name": f"s{i}"}


def _model(x):
    return x @ torch.tensor([[1.0, 0.5], [0.25, -1.0]])


def _ranks_evaluate(world):
    out = {}
    for n in LENGTHS:
        for b in (1, 3):
            for shuffle in (False, True):
                loader = px.data_loader(Samples(n), b, shuffle=shuffle)
                outputs, labels, names, steps = [], [], [], 0
                for batch in loader:
                    steps += 1
                    assert batch["x"].shape[1:] == (2,)  # empty batches keep their shape
                    pair = px.gather_for_metrics((_model(batch["x"]), batch["label"]), loader)
                    outputs.append(pair[0])
                    labels.append(pair[1])
                    names.extend(px.gather_for_metrics(batch["name"], loader))
                out[n, b, shuffle] = (torch.cat(outputs), torch.cat(labels), names, steps)
    # px.gather: ragged tensors, 0-d tensors, bools and objects, in rank order
    r = px.rank()
    out["gather"] = (px.gather(torch.arange(r * 2.0).reshape(r, 2)), px.gather(torch.tensor(r)),
                     px.gather(torch.tensor([r % 2 == 0])), px.gather({"rank": r}))
    # map_batches: every length, results in order on every rank, or on rank 0 only
    out["map"] = {n: px.map_batches(lambda items: [i * i for i in items], list(range(n)), 3)
                  for n in (0,) + LENGTHS}
    out["map_main"] = px.map_batches(lambda items: [str(i) for i in items], range(5), 2,
                                     main_only=True)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gather_for_metrics_and_map_batches(world):
    results = run_ranks(_ranks_evaluate, world, args=(world,), timeout=120)
    for n in LENGTHS:
        data = Samples(n)
        x = torch.stack([data[i]["x"] for i in range(n)])
        reference = _model(x)  # one process over the whole dataset
        for b in (1, 3):
            for shuffle in (False, True):
                steps = {r[n, b, shuffle][3] for r in results}
                assert steps == {-(-n // (b * world))}
                for r in results:  # the same answer on every rank
                    outputs, labels, names, _ = r[n, b, shuffle]
                    assert outputs.shape == (n, 2) and len(labels) == n and len(names) == n
                    ids = outputs[:, 0].div(1.5).round().long()  # x_i = (i, 2i) -> out_i[0] = 1.5 i
                    if not shuffle:
                        assert ids.tolist() == list(range(n))
                    assert sorted(ids.tolist()) == list(range(n))  # each sample exactly once
                    torch.testing.assert_close(outputs, reference[ids])
                    assert labels.tolist() == [i % 3 for i in ids.tolist()]
                    assert names == [f"s{i}" for i in ids.tolist()]

    for rank, r in enumerate(results):
        ragged, scalars, flags, objects = r["gather"]
        assert [t.tolist() for t in ragged] == [
            torch.arange(q * 2.0).reshape(q, 2).tolist() for q in range(world)]
        assert [t.item() for t in scalars] == list(range(world))
        assert [t.tolist() for t in flags] == [[q % 2 == 0] for q in range(world)]
        assert objects == [{"rank": q} for q in range(world)]
        assert r["map"] == {n: [i * i for i in range(n)] for n in (0,) + LENGTHS}
        assert r["map_main"] == ([str(i) for i in range(5)] if rank == 0 else None)


def _expect_error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test looks at the message
        return f"{type(exc).__name__}: {exc}"
    return None


def _ranks_bad_input():
    ds = Samples(10)
    errors = {}
    errors["batch 0"] = _expect_error(px.data_loader, ds, 0)
    errors["sampler batch 0"] = _expect_error(px.DistributedSampler, ds, batch_size=0)
    errors["map batch 0"] = _expect_error(px.map_batches, lambda b: b, [1, 2], 0)
    state = px.data_loader(ds, 2).sampler.state_dict()
    errors["other length"] = _expect_error(px.data_loader(Samples(11), 2).sampler.load_state_dict,
                                           state)
    errors["other seed"] = _expect_error(px.data_loader(ds, 2, seed=1).sampler.load_state_dict,
                                         state)
    plain = DataLoader(ds, batch_size=2)
    errors["foreign loader"] = _expect_error(px.gather_for_metrics, torch.zeros(2), plain)
    errors["dropping loader"] = _expect_error(
        px.gather_for_metrics, torch.zeros(2), px.data_loader(ds, 2, drop_last=True))
    # a failure inside fn on one rank reaches every rank instead of hanging the others
    def fails_on_last_rank(items):
        if px.rank() == px.world_size() - 1:
            raise KeyError("broken item")
        return items
    errors["fn fails"] = _expect_error(px.map_batches, fails_on_last_rank, list(range(9)), 2,
                                      schedule="static")

    def fails_on_item_seven(items):  # whichever rank draws that batch
        if 7 in items:
            raise KeyError("broken item 7")
        return items
    errors["fn fails, dynamic"] = _expect_error(px.map_batches, fails_on_item_seven,
                                                list(range(9)), 2)
    errors["bad schedule"] = _expect_error(px.map_batches, fails_on_item_seven, [1], 1,
                                           schedule="round-robin")
    errors["ragged dims"] = _expect_error(px.gather, torch.zeros(1, px.rank() + 1))
    # the ranks are still in step: a collective after all of that completes
    t = torch.ones(1)
    dist.all_reduce(t)
    return errors, t.item()


def test_bad_input_is_a_clear_error_on_every_rank():
    results = run_ranks(_ranks_bad_input, 3, timeout=60)
    expected = {
        "batch 0": "batch_size must be a positive integer",
        "sampler batch 0": "batch_size must be a positive integer",
        "map batch 0": "batch_size must be a positive integer",
        "other length": "dataset of 10 samples, but this sampler's dataset has 11",
        "other seed": "saved with seed=0, but this sampler has seed=1",
        "foreign loader": "needs the loader made by px.data_loader",
        "dropping loader": "drop_last=False",
        "fn fails": "failed on rank(s) [2]",
        "fn fails, dynamic": "KeyError: 'broken item 7'",
        "bad schedule": "use 'dynamic' (batches to whichever rank is free) or 'static'",
        "ragged dims": "differ beyond the first dimension",
    }
    for errors, total in results:
        assert total == 3.0
        for key, text in expected.items():
            assert errors[key] is not None and text in errors[key], (key, errors[key])
    assert "KeyError: 'broken item'" in results[0][0]["fn fails"]


def _new_records(comm, fn, *args, **kwargs):
    """`fn`'s result and the (kind, tag, bytes) of the collectives it added to `comm`'s record."""
    before = comm.seq
    result = fn(*args, **kwargs)
    return result, [(r.kind, r.tag, r.nbytes) for r in comm.records if r.seq > before]


def _ranks_through_the_comm():
    from torch import nn

    from phalanx.comm.collectives import Comm
    from phalanx.model.sync_batchnorm import convert_sync_batchnorm
    from phalanx.world.runtime import default_comm

    comm, r, seen = default_comm(), px.rank(), {}
    seen["gather"] = _new_records(comm, px.gather, torch.ones(r + 1, 3))[1]
    seen["gather objects"] = _new_records(comm, px.gather, {"rank": r})[1]
    loader = px.data_loader(Samples(5), 2, shuffle=False)
    batch = next(iter(loader))
    seen["gather_for_metrics"] = _new_records(
        comm, px.gather_for_metrics, (batch["x"], batch["name"]), loader)[1]
    seen["map_batches"] = _new_records(comm, px.map_batches, lambda b: b, list(range(5)), 2)[1]
    seen["map_batches main"] = _new_records(comm, px.map_batches, lambda b: b, list(range(5)), 2,
                                            main_only=True)[1]
    count = torch.tensor(float(r + 3))
    loss = torch.tensor(2.0)
    seen["global_mean"] = _new_records(comm, lambda: [px.global_mean(loss, count)
                                                      for _ in range(3)])[1]
    seen["count untouched"] = vars(count) == {}  # no cache written on the user's tensor
    own = Comm(dist.group.WORLD)  # a Comm the caller holds: its record, not the default one
    seen["own comm"] = (_new_records(comm, px.gather, torch.ones(2), own)[1],
                        [(x.kind, x.tag) for x in own.records])

    layer = convert_sync_batchnorm(nn.BatchNorm1d(4))
    x = torch.randn(3, 4).requires_grad_()
    default_before = comm.seq
    layer(x).sum().backward()
    seen["sync_batchnorm"] = [(x.kind, x.tag, x.nbytes) for x in layer.comm.records]
    seen["sync_batchnorm on default"] = comm.seq - default_before
    seen["copy"] = copy.deepcopy(layer).comm is None and layer.comm is not None
    return seen


def test_every_data_collective_and_sync_batchnorm_go_through_a_comm():
    """Each collective is in a Comm's record, with its tag and its bytes: one that went to
    torch.distributed directly would be missing here."""
    results = run_ranks(_ranks_through_the_comm, 2, timeout=60)
    for seen in results:
        # meta then data; rank 1 holds 2 rows, so both ranks gather 2 x (2 x 3) floats
        assert seen["gather"] == [("all_gather", "gather", 2 * 18 * 8),
                                  ("all_gather", "gather", 2 * 2 * 3 * 4)]
        assert [(k, t) for k, t, _ in seen["gather objects"]] == [("all_gather_object", "gather")]
        assert [(k, t) for k, t, _ in seen["gather_for_metrics"]] == [
            ("all_gather", "gather_for_metrics"), ("all_gather", "gather_for_metrics"),
            ("all_gather_object", "gather_for_metrics")]
        assert [(k, t) for k, t, _ in seen["map_batches"]] == [
            ("all_gather_object", "map_batches:status"), ("all_gather_object", "map_batches")]
        assert [(k, t) for k, t, _ in seen["map_batches main"]] == [
            ("all_gather_object", "map_batches:status"), ("gather_object", "map_batches")]
        assert seen["global_mean"] == [("all_reduce", "global_mean", 8)]  # once for 3 calls
        assert seen["count untouched"]
        assert seen["own comm"] == ([], [("all_gather", "gather"), ("all_gather", "gather")])
        # one gather of [mean (4), var (4), count] per forward, one reduce of 2 x 4 per backward
        assert seen["sync_batchnorm"] == [("all_gather", "sync_batchnorm:stats", 2 * 9 * 4),
                                          ("all_reduce", "sync_batchnorm:grads", 8 * 4)]
        assert seen["sync_batchnorm on default"] == 0
        assert seen["copy"]
        for key in ("gather objects", "gather_for_metrics", "map_batches", "map_batches main"):
            assert all(nbytes > 0 for _, _, nbytes in seen[key]), key


def _map_every_count(schedule):
    import time

    def slow_on_rank_zero(items):  # rank 0 is slow, so the others take more batches
        if px.rank() == 0:
            time.sleep(0.01)
        return [(i, i * i) for i in items]

    out = {}
    for n in (0, 1, 7, 100):
        out[n] = px.map_batches(slow_on_rank_zero, list(range(n)), 3, schedule=schedule)
    return out


@pytest.mark.parametrize("schedule", ["dynamic", "static"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_map_batches_gives_every_item_once_in_order_on_every_rank(world, schedule):
    for out in run_ranks(_map_every_count, world, args=(schedule,), timeout=60):
        for n in (0, 1, 7, 100):
            assert out[n] == [(i, i * i) for i in range(n)], (n, out[n][:5])
