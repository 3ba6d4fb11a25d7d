"""staleness=1: step t applies the average of step t-1's gradients (engine/delayed.py), on 2
and 3 ranks, float64, against one process that does exactly that (staleness_runs.py).

What each test pins:
- ddp, zero1, zero2, with SGD (momentum, weight decay) and AdamW, with and without
  accumulation and clipping: parameters AND optimizer state equal the delayed one-process
  reference; the first step runs no optimizer (AdamW's step count is steps - 1), and a layer
  no forward uses is never stepped. The delayed reference is far from the ordinary one, so
  the comparison would see the delay missing.
- a checkpoint saved mid-run holds the gradient on its way: resumed at another world size and
  strategy, the run ends equal to the uninterrupted reference;
- bad values, zero3 and fp16 are refused with a ValueError on every rank, before any
  collective (nobody waits).
"""

import pytest
import torch
from staleness_runs import prepared, reference, result, train

import phalanx as px
from phalanx.testing import run_ranks

STEPS = 5
# float64: the one-process reference against the same update summed in another order differs
# by round-off (~1e-15); a missing or doubled delay moves parameters by more than 1e-3.
RTOL = 1e-10


def assert_same(got, want, context):
    (params, state), (ref_params, ref_state) = got, want
    for i, (a, b) in enumerate(zip(params, ref_params)):
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
        assert err <= RTOL, f"{context}: parameter {i} differs by {err:.2e} (relative)"
    assert sorted(state["state"]) == sorted(ref_state["state"]), context
    for index, entry in ref_state["state"].items():
        for key, value in entry.items():
            got_value = state["state"][index][key]
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                assert torch.allclose(got_value.to(value.dtype), value, rtol=RTOL, atol=1e-14), \
                    f"{context}: optimizer state {index}/{key}"
            else:
                assert float(got_value) == float(value), f"{context}: {index}/{key}"


CASES = [("sgd", 1, None), ("adamw", 2, 0.05)]  # (optimizer, micro-steps, clip)


def _runs(strategy):
    out = {}
    for opt_kind, accum, clip in CASES:
        model, opt = prepared(strategy, opt_kind)
        train(model, opt, STEPS, accum=accum, clip=clip)
        out[(opt_kind, accum, clip)] = result(model, opt)
    return out


@pytest.mark.parametrize("strategy,world", [("ddp", 3), ("zero1", 2), ("zero2", 3)])
def test_staleness_applies_previous_steps_average(strategy, world):
    results = run_ranks(_runs, world, args=(strategy,), timeout=180)
    for (opt_kind, accum, clip), _ in zip(CASES, results[0]):
        want = reference(STEPS, opt_kind, clip)
        ordinary, _ = reference(STEPS, opt_kind, clip, staleness=0)
        gap = max((a - b).abs().max().item() for a, b in zip(want[0], ordinary))
        assert gap > 1e-3, "the delayed reference must differ from the ordinary one"
        for rank, got in enumerate(results):
            assert_same(got[(opt_kind, accum, clip)], want,
                        f"{strategy} {opt_kind} accum {accum} clip {clip} rank {rank}")
    if any(kind == "adamw" for kind, _, _ in CASES):  # the first step ran no optimizer
        steps = {float(s["step"]) for s in results[0][("adamw", 2, 0.05)][1]["state"].values()}
        assert steps == {STEPS - 1.0}


def _save(path, strategy, steps):
    model, opt = prepared(strategy, "adamw")
    train(model, opt, steps, clip=0.05)
    px.save(path, model=model, optimizer=opt, step=steps)


def _resume(path, strategy, steps):
    model, opt = prepared(strategy, "adamw")
    first = px.load(path, model=model, optimizer=opt)["step"]
    train(model, opt, steps, first=first, clip=0.05)
    return result(model, opt)


def test_checkpoint_resumes_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 2, args=(path, "zero2", 3), timeout=120)
    want = reference(STEPS + 1, "adamw", 0.05)
    for got in run_ranks(_resume, 3, args=(path, "zero1", STEPS + 1 - 3), timeout=120):
        assert_same(got, want, "saved at 2 ranks zero2, resumed at 3 ranks zero1")


BAD = [dict(staleness=2), dict(staleness=True), dict(staleness=-1), dict(staleness="1"),
       dict(staleness=1, strategy="zero3"), dict(staleness=1, strategy="fsdp"),
       dict(staleness=1, precision="fp16")]


def _refusals():
    messages = []
    for options in BAD:
        options = {"strategy": "ddp", **options}
        model = torch.nn.Linear(3, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            px.prepare(model, opt, **options)
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append(None)
    return messages


def test_bad_values_refused_on_every_rank():
    results = run_ranks(_refusals, 2, timeout=60)
    for rank, messages in enumerate(results):
        for options, message in zip(BAD, messages):
            assert message is not None, f"rank {rank}: {options} was accepted"
            assert "staleness" in message, message
        assert "zero2" in messages[4] and "bf16" in messages[6], messages


def _nan_on_rank1():
    import torch.nn.functional as F
    from staleness_runs import batch

    model, opt = prepared("ddp")
    seen = []
    for step in range(3):
        x, y = batch(step)
        rows = slice(6 * px.rank(), 6 * px.rank() + 6)
        loss = F.mse_loss(model(x[rows]), y[rows])
        if step == 1 and px.rank() == 1:
            loss = loss * float("nan")
        loss.backward()  # never raises: the gradient goes out unread
        try:
            opt.step()
            seen.append(None)
        except px.NonFiniteError as exc:
            seen.append(str(exc))
        opt.zero_grad()
    return seen, all(torch.isfinite(p).all().item() for p in px.unwrap(model).parameters())


def test_nonfinite_loss_is_raised_where_its_gradient_would_apply():
    for seen, finite in run_ranks(_nan_on_rank1, 2, timeout=60):
        assert seen[0] is None and seen[1] is None and "rank 1" in seen[2], seen
        assert finite
