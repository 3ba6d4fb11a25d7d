"""shard_size with narrow numbers: comm_dtype across groups, precision="bf16", a meta build.

At 4 ranks as 2 groups of 2 (engine/hybrid.py). The model, data and float64 reference are
test_parity64.py's; the meta build is test_zero3.py's.
"""

import test_parity64 as p64
import test_zero3 as tz3
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import engine_of, run_ranks

WORLD = 4


def _one_step(strategy, shard_size, comm_dtype):
    """One SGD step with lr=1 and no momentum, so `before - after` is the averaged gradient."""
    model = p64.make_model("mlp", p64.SEED)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = px.prepare(model, opt, strategy=strategy, bucket_mb=p64.BUCKET_MB,
                            shard_size=shard_size, comm_dtype=comm_dtype)
    before = [t.clone() for t in model.state_dict().values()]
    x, y = p64.make_data("mlp", WORLD * p64.B, 0)
    p64.loss_of("mlp", model, *p64.chunk(x, y, px.rank()), 0).backward()
    opt.step()
    opt.zero_grad()
    after = list(model.state_dict().values())
    engine = engine_of(model)
    units = [(u.hi - u.lo, len(u.params), u.bucket.total_numel, u.bucket.tail_apart)
             for u in engine.units]
    return ([b - a for b, a in zip(before, after)], px.step_stats(model)["inter_group_bytes"],
            units)


def _steps_in_every_layout():
    return {(strategy, dtype): _one_step(strategy, 2, dtype)
            for strategy in ("zero1", "zero2") for dtype in (None, torch.bfloat16)}


def _means(ranks):
    """The float64 mean gradient over `ranks` (each rank's chunk of step 0's batch)."""
    model = p64.make_model("mlp", p64.SEED)
    x, y = p64.make_data("mlp", WORLD * p64.B, 0)
    for r in ranks:
        (p64.loss_of("mlp", model, *p64.chunk(x, y, r), 0) / len(ranks)).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]


def test_comm_dtype_applies_to_the_average_across_groups():
    results = run_ranks(_steps_in_every_layout, WORLD, timeout=180)
    want = _means(range(WORLD))
    # bf16 keeps 8 significant bits: each value is rounded when cast for the group's sum, by
    # that sum, by the replicas' sum (hybrid.py), each within 2**-8 of the largest value
    # summed; 2**-6 of the largest gradient leaves room for those three and a few more.
    scale = max(g.abs().max().item() for g in want)
    tol = 2.0 ** -6 * scale
    group_only = _means([0, 1])  # what rank 0 would hold without the average across groups
    assert max((a - b).abs().max().item() for a, b in zip(group_only, want)) > 4 * tol
    for rank, got in enumerate(results):
        for strategy in ("zero1", "zero2"):
            full, full_bytes, units = got[strategy, None]
            narrow, narrow_bytes, _ = got[strategy, torch.bfloat16]
            context = f"{strategy} rank {rank}"
            for i, (a, b, c) in enumerate(zip(full, narrow, want)):
                torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-14, msg=context)
                err = (b - c).abs().max().item()
                assert err <= tol, f"{context}: parameter {i} off by {err} > {tol}"
            # every replica of a shard holds the same values, so every rank the same model
            for a, b in zip(narrow, results[0][strategy, torch.bfloat16][0]):
                assert torch.equal(a, b), context
            # bytes across: float64 -> bf16 is a quarter, flags and signal included where they
            # come out of the group's reduction in bf16 (a unit whose flags travel apart from
            # its gradient, buckets.py, keeps them at full width); the first backward's launch
            # order (int64 per unit) crosses too
            order = 8 * len(units)
            if strategy == "zero1":
                assert full_bytes == sum(total * 8 for _, _, total, _ in units) + order
                assert narrow_bytes == sum(total * 2 for _, _, total, _ in units) + order
            else:
                assert full_bytes == sum((s + n + 1) * 8 for s, n, _, _ in units) + order
                assert narrow_bytes == sum(s * 2 + (n + 1) * (8 if apart else 2)
                                           for s, n, _, apart in units) + order


# -- precision="bf16" and a meta build, under zero3 -----------------------------------------------
def _build_and_train(meta, shard_size, precision):
    """test_zero3's meta-or-full run with shard_size, SGD (Adam's first step is lr*sign(g),
    which turns a rounding of a tiny gradient into a whole step)."""
    torch.manual_seed(3)
    if meta:
        if px.rank():
            torch.manual_seed(99)  # rank 0's generator is the one that counts
        with torch.device("meta"):
            model = tz3.Plain()
    else:
        model = tz3.Plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy="zero3", precision=precision,
                            shard_size=shard_size)
    # state_dict() reads peers' shards one-sidedly: a peer still in its previous model's
    # prepare would not serve this one's yet
    torch.distributed.barrier()
    initial = {k: v.float().clone() for k, v in model.state_dict().items()}
    for step in range(2):
        tokens = tz3.batch(step, px.rank(), px.world_size())
        logits = model(tokens[:, :-1]).reshape(-1, 13)
        F.cross_entropy(logits.float(), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    torch.distributed.barrier()
    return initial, {k: v.float().clone() for k, v in model.state_dict().items()}


def _three_builds():
    return {"meta": _build_and_train(True, 2, "bf16"), "full": _build_and_train(False, 2, "bf16"),
            "flat": _build_and_train(False, None, "bf16")}


def test_bf16_and_a_meta_build_under_zero3_with_shard_size():
    results = run_ranks(_three_builds, WORLD, timeout=240)
    for rank, got in enumerate(results):
        (init_m, trained_m), (init_h, trained_h) = got["meta"], got["full"]
        init_f, trained_f = got["flat"]
        for key in init_f:
            context = f"rank {rank}: {key}"
            # the meta build draws within each shard group what a full build draws
            assert torch.equal(init_m[key], init_h[key]), context
            assert torch.equal(trained_m[key], trained_h[key]), context
            assert torch.equal(init_h[key], init_f[key]), context
            assert torch.equal(trained_h[key], results[0]["full"][1][key]), context
            # hybrid against flat under bf16: the same steps, the gradients' means rounded in
            # other places (a bf16 sum of 2 in the group, one of 2 across, against one of 4).
            # bf16 rounds each to 2**-8 of the value; over 2 steps the updates agree to 2**-5
            # of how far the parameters moved (measured: within 0.005 of it at most).
            diff = (trained_h[key] - trained_f[key]).abs().max().item()
            moved = (trained_f[key] - init_f[key]).abs().max().item()
            assert diff <= 2.0 ** -5 * moved, (context, diff, moved)
