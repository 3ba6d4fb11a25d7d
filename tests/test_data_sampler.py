"""The sampler and loader on real processes: each epoch is the dataset once, in one order that
does not depend on the world size, and a state saved at one world size resumes at another.

Every rank returns the batches it saw; the parent rebuilds the global stream (step by step,
ranks in order) and compares it with the stream of a world of one and with the dataset.
"""

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import phalanx as px
from phalanx.testing import run_ranks

LENGTHS = (1, 7, 10, 64)
WORLDS = (1, 2, 3, 4)
GLOBAL = 12  # a global batch every world size can share: batch 12 // world per rank
SEED = 3


class Indices(Dataset):
    """Sample i is the number i, so a batch says which samples it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _batch_sizes(world):
    return sorted({1, 2, GLOBAL // world})


def _epoch(loader, stop_after=None, state=None):
    """The batches of one pass; with stop_after, stop there and record the sampler state."""
    out = []
    for batch in loader:
        out.append(batch.tolist())
        if stop_after is not None and len(out) == stop_after:
            state.append(loader.sampler.state_dict())
            break
    return out


def _ranks_sampler(world, incoming):
    """Epochs, and saved states, for every length and batch size; then resume `incoming`."""
    assert px.world_size() == world
    epochs, saved, resumed = {}, {}, {}
    for n in LENGTHS:
        for b in _batch_sizes(world):
            for drop_last in (False, True):
                loader = px.data_loader(Indices(n), b, seed=SEED, drop_last=drop_last)
                first, second = _epoch(loader), _epoch(loader)  # a full pass advances the epoch
                loader.sampler.set_epoch(1)
                again = _epoch(loader)
                epochs[n, b, drop_last] = (first, second, again, len(loader))
            # Save after k batches of epoch 1, for the next world size to resume.
            steps = -(-n // (b * world))
            for k in sorted({1, max(1, steps // 2)}):
                loader = px.data_loader(Indices(n), b, seed=SEED)
                loader.sampler.set_epoch(1)
                state = []
                _epoch(loader, stop_after=k, state=state)
                saved[n, b, k] = state[0] if state else None
    for key, state in incoming.items():
        if state is None:
            continue
        n = key[0]
        for b in _batch_sizes(world):
            loader = px.data_loader(Indices(n), b, seed=SEED)
            loader.sampler.load_state_dict(state)
            loader.sampler.set_epoch(1)  # the usual top-of-epoch call keeps the position
            resumed[key, b] = _epoch(loader)
    return epochs, saved, resumed


def _stream(per_rank_batches, b=None):
    """The global stream: step k of every rank, in rank order; checks equal step counts."""
    counts = {len(batches) for batches in per_rank_batches}
    assert len(counts) == 1, f"ranks took different numbers of batches: {counts}"
    stream = []
    for step in zip(*per_rank_batches):
        if b is not None:
            assert all(len(part) <= b for part in step)
        for part in step:
            stream.extend(part)
    return stream


def test_epochs_cover_the_dataset_once_in_one_order_and_resume_at_any_world_size():
    runs = {}
    incoming = {}
    for world in WORLDS:
        runs[world] = run_ranks(_ranks_sampler, world, args=(world, incoming), timeout=120)
        incoming = runs[world][0][1]
        # every rank saved the same state: it needs no communication and can be taken anywhere
        for r in range(1, world):
            assert runs[world][r][1] == incoming
    # the first world size resumes from the last one's states
    runs["1-again"] = run_ranks(_ranks_sampler, 1, args=(1, incoming), timeout=120)
    saver_world = {2: 1, 3: 2, 4: 3, "1-again": 4}

    # The reference orders: a world of one, one sample per step.
    order = {}
    for n in LENGTHS:
        first, second, _, _ = runs[1][0][0][n, 1, False]
        order[n, 0] = _stream([first])
        order[n, 1] = _stream([second])
        for e in (0, 1):
            assert sorted(order[n, e]) == list(range(n))  # each sample once
        if n >= 7:
            assert order[n, 0] != order[n, 1], "two epochs have the same order"
        if n == 64:
            assert order[n, 0] != list(range(n)), "shuffle=True did not shuffle"

    for world in WORLDS:
        results = runs[world]
        for n in LENGTHS:
            for b in _batch_sizes(world):
                g = b * world
                for drop_last in (False, True):
                    per_rank = [r[0][n, b, drop_last] for r in results]
                    keep = n - n % g if drop_last else n
                    for epoch in (0, 1):
                        stream = _stream([p[epoch] for p in per_rank], b)
                        # the same order at every world size, cut to whole global batches
                        assert stream == order[n, epoch][:keep], (world, n, b, drop_last, epoch)
                    # set_epoch(1) replays epoch 1 exactly
                    assert _stream([p[2] for p in per_rank]) == order[n, 1][:keep]
                    assert {p[3] for p in per_rank} == {-(-keep // g)}  # len(loader)

        # Resume: the states the previous world size saved after k batches.
        if world == 1:
            continue
        check_resume(results, saver_world[world], order)
    check_resume(runs["1-again"], saver_world["1-again"], order)


def check_resume(results, saver_world, order):
    resumed = [r[2] for r in results]
    assert resumed[0], "nothing was resumed"
    for (n, b_saved, k), b in resumed[0]:
        position = min(k * b_saved * saver_world, n)
        stream = _stream([r[(n, b_saved, k), b] for r in resumed], b)
        assert stream == order[n, 1][position:], (n, b_saved, k, b)


def _ranks_workers():
    """Loader workers: the same stream, and a state inside the loop counts what the loop saw."""
    out = {}
    ds = Indices(64)
    plain = px.data_loader(ds, 3, seed=SEED)
    out["plain"] = _epoch(plain)
    loader = px.data_loader(ds, 3, seed=SEED, num_workers=2)
    out["workers"] = _epoch(loader)
    state = []
    loader.sampler.set_epoch(0)
    out["head"] = _epoch(loader, stop_after=3, state=state)
    out["state"] = state[0]
    resumed = px.data_loader(ds, 3, seed=SEED, num_workers=2, persistent_workers=True)
    resumed.sampler.load_state_dict(state[0])
    out["tail"] = _epoch(resumed)
    out["next_epoch"] = _epoch(resumed)  # persistent workers: the next pass is epoch 1
    # A stream: split over ranks and workers without overlap, empty batches at the tail.
    out["stream"] = _epoch(px.data_loader(Stream(23), 2, shuffle=False, num_workers=2))
    out["stream_short"] = [t.shape for t in px.data_loader(Stream(1), 2, shuffle=False)]
    # The sampler on its own, under a plain DataLoader: interleaved, disjoint.
    sampler = px.DistributedSampler(ds, seed=SEED)
    out["plain_sampler"] = [b.tolist() for b in torch.utils.data.DataLoader(
        ds, batch_size=4, sampler=sampler)]
    out["plain_sampler_state"] = sampler.state_dict()
    return out


def test_workers_streams_and_the_plain_sampler():
    results = run_ranks(_ranks_workers, 3, timeout=120)
    world = 3
    order = _stream([r["plain"] for r in results], 3)
    assert sorted(order) == list(range(64))
    assert _stream([r["workers"] for r in results], 3) == order
    assert all(r["state"]["consumed"] == 3 * 3 * world for r in results)  # not the prefetch
    assert _stream([r["head"] for r in results]) == order[:27]
    assert _stream([r["tail"] for r in results]) == order[27:]
    second = _stream([r["next_epoch"] for r in results])
    assert sorted(second) == list(range(64)) and second != order
    # the stream: dataset order, every rank the same number of batches, empty ones at the end
    assert _stream([r["stream"] for r in results], 2) == list(range(23))
    assert [len(r["stream"][-1]) for r in results] == [2, 2, 1]  # 23 = 3 * 6 + 5
    assert [r["stream_short"] for r in results] == [[torch.Size([1])], [torch.Size([0])],
                                                    [torch.Size([0])]]
    # plain DataLoader over the sampler: batch j covers order[12 j : 12 (j + 1)], interleaved
    per_rank = [r["plain_sampler"] for r in results]
    for j in range(len(per_rank[0])):
        step = sorted(i for p in per_rank if j < len(p) for i in p[j])
        assert step == sorted(order[12 * j:12 * (j + 1)])
    assert sorted(i for p in per_rank for b in p for i in b) == list(range(64))
    assert results[0]["plain_sampler_state"]["epoch"] == 1  # a full pass advanced the epoch


@pytest.mark.one_process
def test_len_is_the_whole_epoch_and_what_is_left_has_its_own_name():
    """`len(sampler)` and `len(loader)` count a whole epoch per rank, as PyTorch's do, before
    and after a state is loaded mid-epoch; `samples_left()` and `batches_left()` count what
    the pass from there yields (in one process: ranks given explicitly)."""
    for n in LENGTHS:
        for world in WORLDS:
            for b in (1, 2, 3):
                for drop_last in (False, True):
                    g = world * b
                    saved = px.DistributedSampler(Indices(n), seed=SEED, batch_size=g,
                                                  rank=0, world_size=1, drop_last=drop_last)
                    steps = len(list(saved.batches()))
                    for k in range(steps + 1):  # k global steps consumed, then saved
                        saved._steps_done = k
                        state = saved.state_dict()
                        for rank in range(world):
                            s = px.DistributedSampler(Indices(n), seed=SEED, batch_size=b,
                                                      rank=rank, world_size=world,
                                                      drop_last=drop_last)
                            whole = list(s.batches())
                            s.load_state_dict(state)
                            left = list(s.batches())
                            s.load_state_dict(state)
                            key = (n, world, b, drop_last, k, rank)
                            assert len(s) == sum(map(len, whole)), key
                            assert len(s.batches()) == len(whole) == steps, key
                            assert s.batches_left() == len(left) == steps - k, key
                            assert s.samples_left() == sum(map(len, left)), key
    loader = px.data_loader(Indices(10), 3, seed=SEED)
    seen = [(len(loader), loader.batches_left())]
    for _ in loader:
        seen.append((len(loader), loader.batches_left()))
    seen.append((len(loader), loader.batches_left()))  # the pass done: the next epoch's
    assert seen == [(4, 4), (4, 3), (4, 2), (4, 1), (4, 0), (4, 4)]
    plain = torch.utils.data.DataLoader(Indices(10), batch_size=3, sampler=loader.sampler)
    assert len(plain) == 4 and len(loader.sampler) == 10
