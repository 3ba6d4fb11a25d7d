"""BatchNorm's buffers as torch DDP keeps them, and one rank's buffers in a save.

torch DDP (`broadcast_buffers=True`, its default) broadcasts rank 0's buffers before a forward
that follows a synchronised training forward, the first evaluation forward included, so every
rank evaluates with rank 0's statistics. phalanx broadcast only before forwards with
gradients, so ranks other than 0 evaluated with their own (pytorch/examples' imagenet: eval loss
6.6756 on rank 1 against DDP's 6.6772); and a zero3 save wrote `running_mean` from rank 0 and
`running_var` from rank 1, matching no rank. Now buffers are broadcast at the end of each
synchronised backward ([Note: buffers as torch DDP keeps them] in src/phalanx/model/buffers.py),
and every buffer of a save is rank 0's. Each rank trains on its own batches (the statistics
differ by rank), in float64, against torch DDP in the same processes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from parity import CNN
from torch.nn.parallel import DistributedDataParallel

import phalanx as px
from phalanx.testing import run_ranks

STEPS = 4


def _batch(rank: int, step: int, rows: int = 6):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(rows, 3, 6, 6, generator=g, dtype=torch.float64) * (1 + rank),
            torch.randint(0, 4, (rows,), generator=g))


def _model():
    torch.manual_seed(0)
    return CNN().double()


def _train(model, opt, rank: int, steps, accumulate: int = 1) -> None:
    model.train()
    for step in steps:
        for micro in range(accumulate):
            x, y = _batch(rank, 10 * step + micro)
            last = micro == accumulate - 1
            context = model.no_sync() if not last else _nothing()
            with context:
                (F.cross_entropy(model(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@torch.no_grad()
def _evaluate(model) -> float:
    model.eval()
    x, y = _batch(99, 0, rows=8)  # the same evaluation batch on every rank
    return F.cross_entropy(model(x), y).item()


def _buffers(module) -> dict:
    return {name: b.clone() for name, b in module.named_buffers()}


def _against_ddp(strategy: str, accumulate: int):
    rank = px.rank()
    theirs = DistributedDataParallel(_model())
    their_opt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    mine = _model()
    model, opt = px.prepare(mine, torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9),
                            strategy)
    _train(theirs, their_opt, rank, range(STEPS), accumulate)
    _train(model, opt, rank, range(STEPS), accumulate)
    return (_evaluate(theirs), _evaluate(model), _buffers(theirs.module),
            _buffers(px.unwrap(model)))


@pytest.mark.parametrize("strategy,accumulate", [("ddp", 1), ("zero3", 1), ("zero2", 2)])
def test_every_rank_evaluates_with_torch_ddp_s_statistics(strategy, accumulate):
    for rank, (want, got, their_buffers, buffers) in enumerate(
            run_ranks(_against_ddp, 2, args=(strategy, accumulate), timeout=120)):
        assert abs(got - want) <= 1e-12 * abs(want), f"rank {rank}: {got} against DDP's {want}"
        for name, value in their_buffers.items():
            assert torch.allclose(buffers[name].double(), value.double(), rtol=1e-12,
                                  atol=1e-12), f"rank {rank}: {name} differs from DDP's"


def _uninterrupted_or_resumed(strategy: str, resume_as: str | None, where: str):
    """STEPS steps under `strategy`, a save, then STEPS more; or, with `resume_as`, the save's
    checkpoint loaded into a model prepared under `resume_as`, and the STEPS more there. Each
    rank's evaluation at the end, and the buffers the save wrote."""
    rank = px.rank()
    mine = _model()
    model, opt = px.prepare(mine, torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9),
                            strategy)
    _train(model, opt, rank, range(STEPS))
    saved_buffers = _buffers(px.unwrap(model)) if strategy != "zero3" else \
        {name: value for name, value in model.state_dict().items() if "running" in name}
    px.save(os.path.join(where, "ckpt"), model=model, optimizer=opt)
    if resume_as is not None:
        again = _model()
        model, opt = px.prepare(again, torch.optim.SGD(again.parameters(), lr=0.1,
                                                       momentum=0.9), resume_as)
        px.load(os.path.join(where, "ckpt"), model=model, optimizer=opt)
    _train(model, opt, rank, range(STEPS, 2 * STEPS))
    return _evaluate(model), saved_buffers


def test_a_zero3_save_resumed_under_ddp_evaluates_as_the_uninterrupted_run(tmp_path):
    """Every buffer of the save is rank 0's, and the resumed run evaluates as the run that
    went on, on every rank."""
    went_on = run_ranks(_uninterrupted_or_resumed, 2, args=("zero3", None, str(tmp_path / "a")),
                        timeout=120)
    resumed = run_ranks(_uninterrupted_or_resumed, 2,
                        args=("zero3", "ddp", str(tmp_path / "b")), timeout=120)
    plain = _model()  # the checkpoint as one process reads it
    px.load(str(tmp_path / "b" / "ckpt"), model=plain)
    written = _buffers(plain)
    for name, value in resumed[0][1].items():
        assert torch.equal(written[name], value), \
            f"{name}: the save holds another rank's value than rank 0's"
    for rank, ((want, _), (got, _)) in enumerate(zip(went_on, resumed)):
        assert abs(got - want) <= 1e-12 * abs(want), f"rank {rank}: {got} against {want}"


def _saved_apart(where: str):
    """zero3 with broadcast_buffers=False: each rank's statistics its own; a save; each rank's
    buffers."""
    mine = _model()
    model, opt = px.prepare(mine, torch.optim.SGD(mine.parameters(), lr=0.1), "zero3",
                            broadcast_buffers=False)
    _train(model, opt, px.rank(), range(2))
    px.save(where, model=model, optimizer=opt)
    return {name: value for name, value in model.state_dict().items() if "running" in name}


def test_every_buffer_of_a_save_is_rank_zeros(tmp_path):
    """With buffers that differ by rank (broadcast_buffers=False), the save holds rank 0's
    running mean and variance alike, not one from each rank."""
    ranks = run_ranks(_saved_apart, 2, args=(str(tmp_path / "ckpt"),), timeout=120)
    plain = _model()
    px.load(str(tmp_path / "ckpt"), model=plain)
    written = _buffers(plain)
    for name, value in ranks[0].items():
        assert torch.equal(written[name], value), f"{name} is not rank 0's"
        assert not torch.equal(ranks[1][name], value), f"{name}: the ranks agree, a weak test"
