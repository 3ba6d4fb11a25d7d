"""One rank acts alone (the issue "One rank may act alone"): under zero1, zero2 and zero3, rank 0
evaluates, generates, and takes `state_dict()` / `px.unwrap(model).state_dict()` /
`optimizer.state_dict()` while the other ranks train on (their next forward or backward waits
for rank 0 in a collective) or wait at a barrier. What rank 0 gets equals a single process's
(float64), and the training that follows is bit for bit the training without the side calls.
"""

import copy
import gc
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import engine_of, run_ranks

VOCAB, DIM, CONTEXT, ROWS = 11, 16, 6, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        x = x + self.mix(self.norm(x)).cumsum(dim=1) / x.shape[1]  # causal mixing
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.frozen = nn.Linear(DIM, DIM)  # not trained: full on every rank
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x + 0.1 * self.frozen(x))


def generate(model, idx, tokens):
    """Greedy decoding without a KV cache: the whole context every time."""
    for _ in range(tokens):
        logits = model(idx[:, -CONTEXT:])
        idx = torch.cat((idx, logits[:, -1].argmax(dim=-1, keepdim=True)), dim=1)
    return idx


def _dtype(precision):
    return torch.float64 if precision == "fp32" else torch.float32


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, CONTEXT + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _build(precision):
    torch.manual_seed(0)
    model = TinyLM().to(_dtype(precision))
    if precision != "fp32":
        # bf16 runs are compared with one process's within round-off: SGD keeps a round-off
        # difference small, where Adam turns it into a full-size step for a tiny gradient
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def _train_step(model, opt, step, rows=None):
    x, y = _data(step)
    if rows is not None:
        x, y = x[rows], y[rows]
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad()


def _side_calls(model, opt):
    """What rank 0 does alone: evaluate, generate, take the full state."""
    x, y = _data(1000)
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
        tokens = generate(px.unwrap(model), torch.zeros(2, 1, dtype=torch.long), 4)
    model.train()
    return {"loss": loss, "tokens": tokens.tolist(),
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "raw_state": {k: v.clone() for k, v in px.unwrap(model).state_dict().items()},
            "optimizer": copy.deepcopy(opt.state_dict())}


def _one_process(precision):
    """The reference: one process with the whole batch (phalanx at world 1 for bf16)."""
    model, opt = _build(precision)
    if precision != "fp32":
        model, opt = px.prepare(model, opt, strategy="ddp", precision=precision)
    for step in range(2):
        _train_step(model, opt, step)
    side = _side_calls(model, opt)
    for step in range(2, 4):
        _train_step(model, opt, step)
    return side, {k: v.clone() for k, v in model.state_dict().items()}


def _on_ranks(strategy, precision, others, side):
    model, opt = _build(precision)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    rank, world = px.rank(), px.world_size()
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    for step in range(2):
        _train_step(model, opt, step, rows)
    got = None
    if side and rank == 0:
        got = _side_calls(model, opt)
    if side and others == "barrier":
        px.barrier()
    for step in range(2, 4):
        _train_step(model, opt, step, rows)
    final = {k: v.clone() for k, v in model.state_dict().items()}  # every rank at once
    served = engine_of(model).remote.served
    return got, final, served


def assert_close(got, want, rtol, what):
    if isinstance(want, dict):
        assert sorted(got, key=str) == sorted(want, key=str), f"{what}: keys differ"
        for key in want:
            assert_close(got[key], want[key], rtol, f"{what}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), what
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, rtol, f"{what}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, \
            f"{what}: {got.dtype}{tuple(got.shape)} against {want.dtype}{tuple(want.shape)}"
        # bf16: relative to at least 0.1 (a bias near zero differs by round-off, not by 2%)
        scale = want.double().abs().max().clamp_min(1e-12 if rtol < 1e-6 else 0.1)
        diff = ((got.double() - want.double()).abs().max() / scale).item() if want.numel() else 0
        assert diff <= rtol, f"{what}: differs by {diff:.3g} (relative)"
    elif isinstance(want, float):
        assert abs(got - want) <= rtol * max(1.0, abs(want)), f"{what}: {got} against {want}"
    else:
        assert got == want, f"{what}: {got!r} against {want!r}"


CASES = [("zero1", "fp32", 2, "train"), ("zero2", "fp32", 2, "train"),
         ("zero3", "fp32", 2, "train"), ("zero3", "fp32", 3, "train"),
         ("zero2", "fp32", 3, "barrier"), ("zero3", "fp32", 2, "barrier"),
         ("zero1", "bf16", 2, "train"), ("zero3", "bf16", 3, "barrier")]


@pytest.mark.parametrize("strategy,precision,world,others", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_rank_zero_alone_sees_what_one_process_sees(strategy, precision, world, others):
    want_side, want_final = _one_process(precision)
    results = run_ranks(_on_ranks, world, args=(strategy, precision, others, True), timeout=90)
    plain = run_ranks(_on_ranks, world, args=(strategy, precision, others, False), timeout=90)
    rtol = 1e-10 if precision == "fp32" else 2e-2
    side = results[0][0]
    what = f"{strategy} {precision} at {world} ranks, the others {others}"
    if precision == "fp32":
        assert side["tokens"] == want_side["tokens"], what
    for key in ("loss", "state", "raw_state", "optimizer"):
        assert_close(side[key], want_side[key], rtol, f"{what}: {key}")
    for rank in range(world):
        # the side calls change nothing: bit for bit the run without them
        assert_close(results[rank][1], plain[rank][1], 0.0, f"{what}: rank {rank} afterwards")
        assert_close(results[rank][1], want_final, rtol, f"{what}: rank {rank} final")
    assert all(r[2] > 0 for r in results[1:]), f"{what}: the peers served nothing"


def _peer_gone(strategy):
    model, opt = _build("fp32")
    model, opt = px.prepare(model, opt, strategy=strategy)
    _train_step(model, opt, 0, slice(px.rank() * ROWS // 2, (px.rank() + 1) * ROWS // 2))
    remote = engine_of(model).remote
    message = None
    if px.rank() == 1:
        remote.stop()  # as if rank 1 were stuck outside Python: nothing answers for it
    px.barrier()  # rank 1's service has stopped before rank 0 asks
    if px.rank() == 0:
        remote.timeout = 3.0
        try:  # zero2's parameters are whole on every rank: its optimizer state is not
            model.state_dict() if strategy == "zero3" else opt.state_dict()
        except px.PeerError as exc:
            message = str(exc)
    px.barrier()
    return message


@pytest.mark.parametrize("strategy", [pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_a_peer_that_does_not_answer_is_named_within_the_timeout(strategy):
    message = run_ranks(_peer_gone, 2, args=(strategy,), timeout=60)[0]
    assert message is not None, "rank 0 got no error"
    assert "rank 1 did not answer within 3 s" in message, message
    assert ("shard of unit" if strategy == "zero3" else "optimizer state") in message, message


def _state_then_return(strategy, slow_rank):
    model, opt = _build("fp32")
    model, opt = px.prepare(model, opt, strategy=strategy)
    _train_step(model, opt, 0, slice(px.rank() * ROWS // 2, (px.rank() + 1) * ROWS // 2))
    if px.rank() == slow_rank:
        time.sleep(0.5)  # the other rank returns, and drops its model, first
    return {k: v.clone() for k, v in model.state_dict().items()}


def _two_models_in_turn(strategy):
    first = _state_then_return(strategy, slow_rank=0)
    gc.collect()
    second = _state_then_return(strategy, slow_rank=1)
    return first, second


@pytest.mark.parametrize("strategy", ["zero3"])
def test_every_rank_takes_the_state_and_returns_while_a_slower_peer_still_reads(strategy):
    """The faster rank's model is dropped when its function returns, while the slower one still
    reads that model's shards from it: it failed with 'no prepared model number 0' (1 run in
    about 4800 of the suite here); the dropped model is now kept until a later blocking
    collective ([Note: a model dropped while a peer reads it] in engine/remote.py)."""
    (first0, second0), (first1, second1) = run_ranks(_two_models_in_turn, 2, args=(strategy,),
                                                     timeout=90)
    for got in (second0, first1, second1):
        assert_close(got, first0, 0.0, f"{strategy}: the same state on every rank")


def _asked_while_preparing(slow_in):
    """Rank 1 is slow to finish px.prepare (`slow_in`: drawing its shards of a meta build, or
    registering its model with its shard service) while rank 0 reads the whole state at once."""
    torch.manual_seed(0)
    if slow_in == "drawing":
        with torch.device("meta"):
            model = TinyLM()
    else:
        model = TinyLM()
    if px.rank() == 1:
        from phalanx.engine import remote
        from phalanx.model import materialize

        def slow(fn):
            def run(*args, **kwargs):
                out = fn(*args, **kwargs) if slow_in == "drawing" else None
                time.sleep(1.0)  # after the generator's broadcast, before any value is drawn
                return out if slow_in == "drawing" else fn(*args, **kwargs)
            return run
        if slow_in == "drawing":
            materialize._same_generator_state = slow(materialize._same_generator_state)
        else:
            remote.ShardService.register = slow(remote.ShardService.register)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    model, opt = px.prepare(model, opt, strategy="zero3")
    state = {k: v.clone() for k, v in model.state_dict().items()} if px.rank() == 0 else None
    px.barrier()
    return state


@pytest.mark.parametrize("slow_in", ["drawing", "registering"])
def test_a_peer_asked_before_it_finished_preparing_answers_once_it_has(slow_in):
    """Rank 0 returns from px.prepare and reads rank 1's shards while rank 1 is still in it:
    rank 1 answered with the zeros its masters start from (a meta build's values are drawn
    after its engine exists; test_zero3.py's meta-build test read a LayerNorm's weight back as
    zeros now and then), or with 'no prepared model number 0' before registering it. Both
    failed here before the fix. A model is now served once px.prepare has finished with it
    (engine/remote.py, [Note: served once prepared])."""
    torch.manual_seed(0)
    want = TinyLM().state_dict()
    got = run_ranks(_asked_while_preparing, 2, args=(slow_in,), timeout=60)[0]
    assert_close(got, want, 0.0, f"rank 0's state while rank 1 was slow {slow_in}")
