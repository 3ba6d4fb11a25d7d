"""zero3 under forwards that are not one straight pass over the model, all on real ranks against
one process or a run without the twist, in float64: activation checkpointing (blocks freed and
prefetched while backward recomputes them), a part of a gathered block called on its own, a
branch on the rank inside one gathered module and across two, a parameter replaced after
prepare, and two models trained turn by turn in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from parity import Chain
from torch.utils.checkpoint import checkpoint

import phalanx as px
from phalanx.testing import engine_of, run_ranks

DTYPE = torch.float64


def _replaced(how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model, opt = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="zero3")
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    inner = px.unwrap(model)
    if how == "data":
        inner[0].weight.data = torch.zeros(8, 4)
    else:
        inner[0].weight = nn.Parameter(torch.zeros(8, 4))
    try:
        model(torch.randn(2, 4))
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("how, match", [
    ("data", "a parameter was given new storage after px.prepare"),
    ("module", "a parameter was added or replaced"),
])
def test_a_parameter_replaced_after_prepare_is_refused_under_zero3(how, match):
    for message in run_ranks(_replaced, 2, args=(how,)):
        assert message is not None and match in message


class Checkpointed(nn.Module):
    """Eight blocks: one activation checkpoint over all of them, one per block (reentrant), or
    none."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh())
                                    for _ in range(8))

    def run(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True) if self.how == "each" else block(x)
        return x

    def forward(self, x):
        if self.how == "segment":
            return checkpoint(self.run, x, use_reentrant=False)
        return self.run(x)


def _checkpointed(how):
    torch.manual_seed(0)
    model = Checkpointed(how).double()
    model, opt = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            strategy="zero3")
    gatherer = engine_of(model).gatherer
    for step in range(4):
        g = torch.Generator().manual_seed(step * 7 + px.rank())
        x = torch.randn(4, 32, generator=g, dtype=DTYPE, requires_grad=how == "each")
        before = gatherer.prefetched
        out = model(x)
        forward = gatherer.prefetched - before
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    block = sum(u.full_bytes for u in gatherer.roots[0].units)
    return (gatherer.peak_bytes / block, gatherer.prefetched - before - forward,
            {k: v.clone() for k, v in model.state_dict().items()})


def test_checkpointed_blocks_are_freed_and_prefetched_in_backward():
    """A checkpoint over all eight blocks recomputes them in backward: each is freed when the
    next one's recomputation starts (3 blocks gathered at most: the one whose backward runs,
    one prefetched, the one recomputing; all 8 were kept before). Reentrant checkpoints per
    block run nested backwards: the end of the outer one frees, and backward still prefetches
    in the recorded order. Training is the same as without checkpoints, in float64."""
    plain = run_ranks(_checkpointed, 2, args=("none",))
    for how in ("segment", "each"):
        for (peak, backward_prefetches, state), (_, _, want) in zip(
                run_ranks(_checkpointed, 2, args=(how,)), plain):
            assert peak <= 3, (how, peak)
            assert backward_prefetches >= 6, (how, backward_prefetches)
            for key, value in want.items():
                torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-14)


def _part_of_a_kept_root():
    torch.manual_seed(0)
    model = Checkpointed("none")
    model, opt = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            strategy="zero3", reshard_after_forward=False)
    model(torch.randn(2, 32))  # every block stays gathered until backward
    with pytest.raises(RuntimeError, match="zero3: module 'blocks.3.0' was called on its own"):
        px.unwrap(model).blocks[3][0](torch.randn(2, 32))
    return True


def test_a_part_of_a_gathered_root_called_outside_its_forward_is_refused():
    """Refused whether or not its parameters happen to be gathered (kept, or prefetched)."""
    assert all(run_ranks(_part_of_a_kept_root, 2))


class Heads(nn.Module):
    """Two equal heads, one chosen by the rank."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, h):
        return self.left(h) if px.rank() == 0 else self.right(h)


class RankBranch(nn.Module):
    """grouped: the heads inside one module, gathered as a whole (its root); otherwise each
    head is a child of the model, so a root of its own."""

    def __init__(self, grouped):
        super().__init__()
        self.grouped = grouped
        self.trunk = nn.Linear(16, 16)
        if grouped:
            self.heads = Heads()
        else:
            self.left, self.right = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if self.grouped:
            return self.heads(h)
        return self.left(h) if px.rank() == 0 else self.right(h)

    def head(self, r):
        heads = self.heads if self.grouped else self
        return heads.left if r == 0 else heads.right


def _rank_branch(grouped, reference=False):
    torch.manual_seed(0)
    model = RankBranch(grouped).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if not reference:  # units of one parameter each: the heads apart, as in a large model
        model, opt = px.prepare(model, opt, strategy="zero3", bucket_mb=1e-5)
    for step in range(3):
        ranks = range(2) if reference else [px.rank()]
        loss = 0
        for r in ranks:  # one process: rank r's batch through rank r's head, averaged
            g = torch.Generator().manual_seed(step * 10 + r)
            x = torch.randn(4, 16, generator=g, dtype=DTYPE)
            out = model.head(r)(torch.tanh(model.trunk(x))) if reference else model(x)
            loss = loss + out.square().mean() / len(ranks)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _refused_branch():
    with pytest.raises(RuntimeError, match="zero3: the ranks gathered different modules in this "
                                           "forward \\(gather 2: rank 0 'left', rank 1 "
                                           "'right'\\)"):
        _rank_branch(False)
    return True


def test_a_branch_on_the_rank_inside_one_gathered_module_trains_and_across_two_is_refused():
    """Inside one root, rank 0's head gets gradients and rank 1's does not (and the other way
    round): their units are ready mid-backward on one rank and at its end on the other, while
    backward gathers the trunk; gathers and reductions are two sequences on two groups, so it
    trains as one process does, in float64 (it hung before). Across roots, rank 0 would gather
    'left' while rank 1 gathers 'right' (the same size, so the values would be each other's):
    every rank raises, naming them."""
    want = _rank_branch(True, reference=True)
    for got in run_ranks(_rank_branch, 2, args=(True,)):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-14)
    assert all(run_ranks(_refused_branch, 2))


def _two_models(interleaved):
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = Chain([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)]).double()
        models.append(px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 strategy="zero3"))
    order = [0, 1, 0, 1, 0, 1] if interleaved else [0, 0, 0, 1, 1, 1]
    steps = [0, 0]
    for which in order:
        model, opt = models[which]
        g = torch.Generator().manual_seed(steps[which] * 10 + which * 100 + px.rank())
        steps[which] += 1
        model(torch.randn(4, 16, generator=g, dtype=DTYPE)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    groups = {id(engine_of(m).gatherer.comm.group) for m, _ in models}
    return len(groups), [{k: v.clone() for k, v in m.state_dict().items()} for m, _ in models]


def test_two_zero3_models_in_one_process_share_the_gathers_group_and_train_alike():
    """One group for every model's gathers (Comm.apart makes it once per process and purpose); two
    models trained turn by turn end where each trained alone ends."""
    together = run_ranks(_two_models, 2, args=(True,))
    apart = run_ranks(_two_models, 2, args=(False,))
    for (groups, states), (_, want) in zip(together, apart):
        assert groups == 1
        for got, expected in zip(states, want):
            for key, value in expected.items():
                assert torch.equal(got[key], value), key
