"""px.DistributedSampler against its Notes (data/sampler.py), one process playing every rank
(each sampler is given its rank and world size): the order, the split of each global batch,
the tail of an epoch, lengths, and a state saved at one world size resumed at another. The
reference is the epoch's global order, cut by hand."""

from __future__ import annotations

import itertools

import pytest
import torch

import phalanx as px

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)


def _samplers(n, world, batch, **kw):
    return [px.DistributedSampler(range(n), rank=r, world_size=world, batch_size=batch, **kw)
            for r in range(world)]


def _steps(samplers):
    """Each global step's indices, rank 0's part first, over one pass of every rank's
    sampler (as a loader iterating each rank's batches would)."""
    per_rank = [list(s.batches()) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1, "ranks took different numbers of steps"
    for s in samplers:  # the loader's report that each batch reached the loop, then the end
        for _ in range(len(per_rank[0])):
            s._batch_consumed()
        s._pass_finished()
    return [sum(parts, []) for parts in zip(*per_rank)]


def test_one_order_at_any_world_size_each_rank_a_contiguous_slice():
    n, world, batch = 50, 3, 4
    samplers = _samplers(n, world, batch, seed=7)
    order = samplers[0].global_order().tolist()
    assert sorted(order) == list(range(n)) and order != list(range(n))
    for s in samplers:
        assert s.global_order().tolist() == order
    steps = _steps(samplers)
    assert sum(steps, []) == order  # the order, cut into global batches, no sample repeated
    # the same stream at world 1 with the same global batch, and at world 2
    assert _steps(_samplers(n, 1, world * batch, seed=7)) == steps
    assert _steps(_samplers(n, 2, world * batch // 2, seed=7)) == steps
    # rank r's part of a full global batch is the r-th slice of `batch` samples
    first = [list(s.batches())[0] for s in _samplers(n, world, batch, seed=7)]
    assert first == [order[r * batch:(r + 1) * batch] for r in range(world)]


def test_the_tail_is_split_evenly_in_rank_order_and_drop_last_leaves_it_out():
    n, world, batch = 26, 4, 3  # global batch 12: two full steps, a tail of 2
    samplers = _samplers(n, world, batch, shuffle=False)
    tail = [list(s.batches())[-1] for s in samplers]
    assert tail == [[24], [25], [], []]  # fewer than the world: later ranks get nothing
    assert [len(s) for s in samplers] == [7, 7, 6, 6]
    assert all(len(s.batches()) == 3 for s in samplers)  # every rank, the same steps
    dropped = _samplers(n, world, batch, shuffle=False, drop_last=True)
    assert [len(s) for s in dropped] == [6] * 4
    assert sum(_steps(dropped), []) == list(range(24))


def test_lengths_before_during_and_after_an_epoch():
    n, world, batch = 30, 2, 4  # global batch 8: 4 steps, the last of 6
    s = _samplers(n, world, batch, seed=1)[1]
    assert len(s) == 15 and len(s.batches()) == 4
    assert s.samples_left() == 15 and s.batches_left() == 4
    it = iter(s)
    taken = list(itertools.islice(it, 8))  # two of this rank's batches
    assert len(taken) == 8 and s.position() == 16
    assert s.batches_left() == 2 and s.samples_left() == 7
    assert len(s) == 15 and len(s.batches()) == 4  # the epoch's, whatever is left of it
    rest = list(it)
    assert len(rest) == 7 and s.epoch == 1 and s.position() == 0  # a pass moves the epoch on
    assert s.batches_left() == 4


def test_a_state_saved_at_two_ranks_resumes_at_three_with_exactly_the_unseen_samples():
    n = 47
    before = _samplers(n, 2, 6, seed=3)  # global batch 12
    order = before[0].global_order().tolist()
    seen = []
    for s in before:
        it = iter(s)
        seen += list(itertools.islice(it, 12))  # two global steps: 24 samples in all
    state = before[0].state_dict()
    assert state["consumed"] == 24 and state["epoch"] == 0
    after = _samplers(n, 3, 4, seed=3)  # the same global batch of 12 at another world size
    for s in after:
        s.load_state_dict(state)
        assert s.batches_left() == 2  # 23 left: a step of 12 and a tail of 11
    assert [len(s) for s in after] == [16, 16, 15]  # the whole epoch's: 3 x 4, then 4, 4, 3
    steps = _steps(after)
    assert sorted(seen + sum(steps, [])) == list(range(n))  # nothing seen twice or lost
    assert sum(steps, []) == order[24:]  # and in the epoch's order from where it stopped


def test_setting_the_epoch_it_is_in_keeps_the_position_and_another_starts_it_over():
    s = _samplers(40, 2, 5, seed=0)[0]
    it = iter(s)
    list(itertools.islice(it, 5))
    state = s.state_dict()
    resumed = _samplers(40, 2, 5, seed=0)[0]
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the loop's set_epoch at the top of the epoch: the resume stands
    assert resumed.position() == 10
    resumed.set_epoch(1)
    assert resumed.position() == 0 and resumed.epoch == 1
    assert resumed.global_order(1).tolist() != resumed.global_order(0).tolist()


@pytest.mark.parametrize("change,message", [
    ({"dataset": range(41)}, "saved for a dataset of 40 samples"),
    ({"seed": 1}, "saved with seed=0"),
    ({"shuffle": False}, "saved with shuffle=True"),
])
def test_a_state_for_another_sampler_is_refused_saying_what_differs(change, message):
    state = px.DistributedSampler(range(40), rank=0, world_size=2).state_dict()
    dataset = change.pop("dataset", range(40))
    other = px.DistributedSampler(dataset, rank=0, world_size=2, **change)
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(state)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        px.DistributedSampler(range(4), rank=0, world_size=1, batch_size=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        px.DistributedSampler(range(4), rank=0, world_size=1, seed=1.5)
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        px.DistributedSampler(range(4), rank=2, world_size=2)
    with pytest.raises(TypeError, match="needs a dataset with a length"):
        px.DistributedSampler(iter(range(4)), rank=0, world_size=1)
    assert torch.equal(px.DistributedSampler(range(5), shuffle=False, rank=0,
                                             world_size=1).global_order(), torch.arange(5))
