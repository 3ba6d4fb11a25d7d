"""The multi-process harness: results come back by rank, failures and hangs become errors."""

import time

import pytest
import torch
import torch.distributed as dist

import phalanx as px
from phalanx.testing import RanksFailed, RanksTimedOut, run_ranks


def _sum_of_ranks():
    t = torch.tensor([float(px.rank())])
    dist.all_reduce(t)
    return px.rank(), px.world_size(), t.item()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_results_come_back_in_rank_order(n):
    results = run_ranks(_sum_of_ranks, n, timeout=60) if n > 1 else None
    if n == 1:
        results = run_ranks(lambda: (px.rank(), px.world_size(), 0.0), 1, timeout=60)
    expected_sum = float(sum(range(n)))
    assert results == [(r, n, expected_sum) for r in range(n)]


def _raise_on_rank_one():
    if px.rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()


def test_a_raising_rank_fails_the_run_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raise_on_rank_one, 3, timeout=60)
    assert "rank 1 failed" in str(info.value)
    assert "ValueError: rank one is broken" in str(info.value)
    assert time.monotonic() - start < 30


def _rank_zero_sleeps_in_python():
    if px.rank() == 0:
        time.sleep(600)
    return px.rank()


def _rank_zero_skips_the_collective():
    if px.rank() != 0:
        dist.all_reduce(torch.ones(1))  # rank 0 never joins: a real deadlock
    else:
        time.sleep(600)


@pytest.mark.parametrize("fn", [_rank_zero_sleeps_in_python, _rank_zero_skips_the_collective])
def test_a_stuck_rank_times_out_with_its_stack(fn):
    start = time.monotonic()
    with pytest.raises((RanksTimedOut, RanksFailed)) as info:
        run_ranks(fn, 2, timeout=4)
    elapsed = time.monotonic() - start
    assert elapsed < 15, f"the harness took {elapsed:.1f} s to give up"
    assert fn.__name__ in str(info.value)  # the stuck rank's Python stack names the function


def _dies_hard():
    import os
    if px.rank() == 1:
        os._exit(7)
    dist.barrier()


def test_a_rank_that_dies_without_a_word_is_reported():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_dies_hard, 2, timeout=30)
    assert "exit code 7" in str(info.value)
