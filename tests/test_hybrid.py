"""shard_size: zero1/zero2/zero3 sharded within groups of ranks, replicated across them
(engine/hybrid.py), against one process in float64, its bytes counted, its checkpoints moved.

The model, data and single-process reference are test_parity64.py's. Rank r trains the chunk
of "virtual rank" v = PERM[r] (the even v first, then the odd), which takes Branchy's branch v % 2:
with 4 ranks in groups of 2, the first group takes only the left branch and the second only
the right, so a parameter unused by a whole group must still be stepped from the other's
gradient (the used-flags averaged across groups), and `never_used` by none.
"""

import contextlib

import pytest
import test_parity64 as p64
import torch

import phalanx as px
from phalanx.engine.hybrid import check_shard_size
from phalanx.engine.policy import POLICIES
from phalanx.testing import engine_of, run_ranks

STEPS = p64.STEPS


def perm(world):
    return [v for v in range(world) if v % 2 == 0] + [v for v in range(world) if v % 2]


def train_on_rank(name, opt_kind, world, accum, clip, strategy, shard_size, model_out=None):
    """test_parity64's loop on this rank as virtual rank PERM[rank], with shard_size."""
    v = perm(world)[px.rank()]
    model = p64.make_model(name, p64.SEED + px.rank())  # prepare must broadcast
    opt = p64.make_optimizer(opt_kind, model)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=p64.BUCKET_MB,
                            shard_size=shard_size)
    for step in range(STEPS):
        x, y = p64.make_data(name, world * accum * p64.B, step)
        for a in range(accum):
            last = a == accum - 1
            with contextlib.nullcontext() if last else px.no_sync(model):
                part = p64.chunk(x, y, a * world + v)
                (p64.loss_of(name, model, *part, v) / accum).backward()
        if clip:
            px.clip_grad_norm_(model, p64.CLIP)
        opt.step()
        opt.zero_grad()
    if model_out is not None:
        model_out.extend([model, opt])
    sd = model.state_dict()
    params = [sd[n] for n, _ in px.unwrap(model).named_parameters()]
    return params, px.optimizer_state_dict(opt)


def _train_all(world, strategy, shard_size, combos):
    return {combo: train_on_rank(combo[0], combo[1], world, combo[2], combo[3], strategy,
                                 shard_size) for combo in combos}


def check_against_reference(results, world, strategy, shard_size, combos):
    for combo in combos:
        want_params, want_state = p64.reference(combo[0], combo[1], world, combo[2], combo[3])
        untouched = [i for i in range(len(want_params)) if i not in want_state["state"]]
        initial = list(p64.make_model(combo[0], p64.SEED).parameters())
        for rank, got in enumerate(results):
            params, state = got[combo]
            context = f"{strategy} shard_size={shard_size} {combo} world {world} rank {rank}"
            assert len(params) == len(want_params), context
            for i, (a, b) in enumerate(zip(params, want_params)):
                p64.assert_close(a, b, f"{context}: parameter {i}")
            p64.assert_state_dicts_equal(state, want_state, context)
            for i in untouched:
                assert torch.equal(params[i], initial[i].detach()), f"{context}: parameter {i}"


# Branchy with AdamW, clipping and accumulation (a parameter unused by a whole group, one by
# every rank, a frozen one); the transformer with SGD (several units per block).
QUICK = [("branchy", "adamw", 2, True), ("transformer", "sgd", 1, False)]


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_two_groups_of_two_match_one_process(strategy):
    results = run_ranks(_train_all, 4, args=(4, strategy, 2, QUICK), timeout=240)
    check_against_reference(results, 4, strategy, 2, QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("world,shard_size", [(4, 2), (6, 2), (6, 3)])
def test_every_combination_matches_one_process(strategy, world, shard_size):
    results = run_ranks(_train_all, world, args=(world, strategy, shard_size, p64.COMBOS),
                        timeout=600)
    check_against_reference(results, world, strategy, shard_size, p64.COMBOS)


@pytest.mark.one_process
def test_the_groups_take_different_branches():
    """The permutation does what the module docstring says (else the flags test is vacuous)."""
    assert perm(4) == [0, 2, 1, 3]
    assert [v % 2 for v in perm(4)[:2]] == [0, 0] and [v % 2 for v in perm(4)[2:]] == [1, 1]


# -- bytes -------------------------------------------------------------------------------------
def _bytes_of_a_step(shard_size):
    import torch.distributed as dist
    world = px.world_size()
    model = p64.make_model("transformer", p64.SEED)
    opt = p64.make_optimizer("sgd", model)
    model, opt = px.prepare(model, opt, strategy="zero3", bucket_mb=p64.BUCKET_MB,
                            shard_size=shard_size)
    engine = engine_of(model)
    for step in range(2):
        x, y = p64.make_data("transformer", world * p64.B, step)
        p64.loss_of("transformer", model, *p64.chunk(x, y, px.rank()), 0).backward()
        opt.step()
        opt.zero_grad()
    stats = px.step_stats(model)
    item = 8  # float64
    # across groups, per unit: its owned gradient shard, and its flags and signal
    planned = sum((u.hi - u.lo) * item + (len(u.params) + 1) * item for u in engine.units)
    members = dist.get_process_group_ranks(engine.comm.group)
    gathers = dist.get_process_group_ranks(engine.gatherer.comm.group)
    return {"stats": stats, "planned_inter": planned, "members": members, "gathers": gathers,
            "units": len(engine.units)}


def test_zero3_gathers_stay_in_the_group_and_only_gradient_shards_cross():
    hybrid = run_ranks(_bytes_of_a_step, 4, args=(2,), timeout=120)
    flat = run_ranks(_bytes_of_a_step, 4, args=(None,), timeout=120)
    for rank, got in enumerate(hybrid):
        stats = got["stats"]
        first = rank - rank % 2
        assert got["members"] == [first, first + 1] and got["gathers"] == got["members"]
        assert stats["inter_group_bytes"] == got["planned_inter"], rank
        assert stats["intra_group_bytes"] + stats["inter_group_bytes"] == stats["comm_bytes"]
        # within the group, a unit's gather is of the whole unit as in the flat layout (padded
        # to a multiple of 2 ranks instead of 4: never more)
        assert 0.95 < stats["all_gather/bytes"] / flat[rank]["stats"]["all_gather/bytes"] <= 1
    for got in flat:
        assert got["stats"]["inter_group_bytes"] == 0
        assert got["members"] == [0, 1, 2, 3]


# -- checkpoints -------------------------------------------------------------------------------
def _save_then_load(path, world_from):
    """Train under zero3 shard_size=2 at `world_from` ranks and save; the same ranks load the
    checkpoint under zero1 shard_size=2 and flat zero2 and must hold the saved state."""
    out = []
    params, state = train_on_rank("branchy", "adamw", world_from, 1, True, "zero3", 2,
                                  model_out=out)
    px.save(path, model=out[0], optimizer=out[1])
    loaded = {}
    for strategy, shard_size in (("zero1", 2), ("zero2", None)):
        model = p64.make_model("branchy", 0)
        opt = p64.make_optimizer("adamw", model)
        model, opt = px.prepare(model, opt, strategy=strategy, shard_size=shard_size)
        px.load(path, model=model, optimizer=opt)
        loaded[strategy] = ([p.detach().clone() for p in px.unwrap(model).parameters()],
                            px.optimizer_state_dict(opt))
    return params, state, loaded


def _load_at(path, strategy, shard_size):
    model = p64.make_model("branchy", 0)
    opt = p64.make_optimizer("adamw", model)
    model, opt = px.prepare(model, opt, strategy=strategy, shard_size=shard_size)
    px.load(path, model=model, optimizer=opt)
    sd = model.state_dict()
    return [sd[n] for n, _ in px.unwrap(model).named_parameters()], px.optimizer_state_dict(opt)


def test_checkpoints_move_between_shard_sizes_strategies_and_world_sizes(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_then_load, 4, args=(path, 4), timeout=180)
    params, state, _ = saved[0]
    for rank, (_, _, loaded) in enumerate(saved):
        for strategy, (got_params, got_state) in loaded.items():
            context = f"loaded under {strategy} at 4 ranks, rank {rank}"
            for i, (a, b) in enumerate(zip(got_params, params)):
                assert torch.equal(a, b), f"{context}: parameter {i}"
            p64.assert_state_dicts_equal(got_state, state, context)
    for world, strategy, shard_size in ((2, "zero3", None), (1, "ddp", None)):
        for rank, (got_params, got_state) in enumerate(
                run_ranks(_load_at, world, args=(path, strategy, shard_size), timeout=120)):
            context = f"loaded under {strategy} at {world} ranks, rank {rank}"
            for i, (a, b) in enumerate(zip(got_params, params)):
                assert torch.equal(a, b), f"{context}: parameter {i}"
            p64.assert_state_dicts_equal(got_state, state, context)


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.one_process
@pytest.mark.parametrize("shard_size,strategy,match", [
    (3, "zero2", "does not divide the world size 4"),
    (2, "ddp", "ddp shards nothing"),
    (1, "zero1", "shard_size=1 shards nothing"),
    (0, "zero3", "a number of ranks"),
    ("two", "zero3", "a number of ranks"),
])
def test_bad_shard_sizes_are_refused_by_name(shard_size, strategy, match):
    with pytest.raises(ValueError, match=match):
        check_shard_size(shard_size, POLICIES[strategy], 4)


@pytest.mark.one_process
def test_shard_size_node_reads_the_launcher(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert check_shard_size("node", POLICIES["zero3"], 4) == 2
    assert check_shard_size(4, POLICIES["zero3"], 4) is None  # the whole world: the flat layout
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        check_shard_size("node", POLICIES["zero3"], 4)
    with pytest.raises(ValueError, match="staleness=1"):
        check_shard_size(2, POLICIES["zero2"], 4, staleness=1)


def _refused_on_every_rank():
    model = p64.make_model("mlp", p64.SEED)
    with pytest.raises(ValueError, match="does not divide"):
        px.prepare(model, p64.make_optimizer("sgd", model), strategy="zero2", shard_size=3)
    return True


def test_a_bad_shard_size_is_refused_on_every_rank_before_any_collective():
    assert run_ranks(_refused_on_every_rank, 4, timeout=60) == [True] * 4



# -- the planner -----------------------------------------------------------------------------------
WIDTH = 256


def wide_model():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)]
    return torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])


def _counted_bytes():
    """Each strategy's step report at 4 ranks as 2 groups of 2 (fp32, gloo)."""
    out = {}
    for strategy in ("zero1", "zero2", "zero3"):
        model = wide_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt = px.prepare(model, opt, strategy=strategy, shard_size=2)
        for step in range(2):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step + px.rank()))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out[strategy] = px.step_stats(model)
    return out


def test_the_planners_bytes_within_and_across_groups_are_the_engines():
    counted = run_ranks(_counted_bytes, 4, timeout=120)
    for strategy in ("zero1", "zero2", "zero3"):
        planned = px.plan(wide_model(), gpus=2, nodes=2, shard_size=2, precision="fp32",
                          optimizer="sgd", strategy=strategy, backend="gloo",
                          input_shape=str(WIDTH))[strategy]
        grads = 4 * sum(p.numel() for p in wide_model().parameters())
        # across: the 1/2 shard (zero2, zero3) or the whole gradient (zero1); the engine adds
        # each unit's used-flags and padding, a few bytes
        assert planned.inter_group_payload_bytes == (grads if strategy == "zero1" else grads // 2)
        for rank, stats in enumerate(counted):
            got = stats[strategy]
            assert got["inter_group_bytes"] == pytest.approx(
                planned.inter_group_payload_bytes, rel=1e-3), (strategy, rank)
            if strategy != "zero3":  # (zero3's gathers in backward depend on its roots)
                assert got["intra_group_bytes"] == pytest.approx(
                    planned.intra_group_payload_bytes, rel=1e-3), (strategy, rank)
    flat = px.plan(wide_model(), gpus=2, nodes=2, precision="fp32", optimizer="sgd",
                   backend="gloo", input_shape=str(WIDTH))
    hybrid = px.plan(wide_model(), gpus=2, nodes=2, shard_size="node", precision="fp32",
                     optimizer="sgd", backend="gloo", input_shape=str(WIDTH))
    for strategy in ("zero1", "zero2", "zero3"):  # memory: the formula with K=2 for N=4
        assert flat[strategy].inter_group_payload_bytes == 0
        assert hybrid[strategy].optimizer_bytes >= flat[strategy].optimizer_bytes
    assert hybrid["zero3"].params_bytes == 2 * flat["zero3"].params_bytes
