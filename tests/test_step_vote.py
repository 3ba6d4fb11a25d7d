"""The per-step vote: an exception in one rank's step drops that step on every rank, nobody
dies, and training goes on at full size, equal to one process that skipped the batch (float64).

See [Note: the step vote] in engine/vote.py. The training and the ways a loop meets the error
(caught around forward and backward; escaping the step to an outer loop, which is what
"uncaught" can mean for a rank that goes on; in an accumulation micro-step) are in
step_vote_runs.py. One job of two ranks runs every case under every strategy; the launcher
cases run tests/launch_scripts/step_vote.py on three ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import step_vote_runs as runs
import torch
from test_launch import processes_running
from torch import nn

import phalanx as px
from phalanx.testing import RanksFailed, engine_of, run_ranks

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
COMBOS = [  # (loop, where the fault is, the rank that hits it); None: no fault
    ("caught", "backward", 1), ("caught", "forward", 0),
    ("outer", "backward", 1), ("outer", "forward", 1), ("saved", "backward", 1),
    ("accumulate", "backward", 1), ("accumulate", "forward", 0),
    ("clipped", "backward", 1), ("scheduled", "backward", 1), ("scaled", "backward", 1),
]
# without a fault: what a healthy step communicates, in each loop that adds a collective of its
# own (the others communicate as "caught" does)
HEALTHY = ("caught", "accumulate", "clipped", "scaled")
COMBOS += [(loop, None, None) for loop in HEALTHY]
SCRIPT = Path(__file__).parent / "launch_scripts" / "step_vote.py"


def _every_case():
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        results = runs.cases(STRATEGIES, COMBOS)
    return results, [str(w.message) for w in said if "dropped on every rank" in str(w.message)]


def test_a_step_that_raised_on_one_rank_is_skipped_by_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("VOTE_SAVE_DIR", str(tmp_path))  # the "saved" loop's checkpoints
    results = run_ranks(_every_case, 2, timeout=300)
    for combo in COMBOS:
        want, _, _ = runs.train(None, *combo)
        for rank, (per_case, _) in enumerate(results):
            for strategy in STRATEGIES:
                got, sent, _ = per_case[(strategy, combo)]
                for i, (a, b) in enumerate(zip(got, want)):
                    # float64: only the order of the additions differs from one process
                    assert (a - b).abs().max().item() < 1e-12, \
                        f"{strategy} {combo} rank {rank}: tensor {i} off the one process's"
                if combo[0] == "saved":  # px.save's pickled reports vary by a few bytes
                    continue
                # a step after the vote communicates what any healthy step does
                loop = combo[0] if combo[0] in HEALTHY else "caught"
                healthy = per_case[(strategy, (loop, None, None))]
                assert sent == healthy[1], \
                    f"{strategy} {combo}: {sent} bytes in a healthy step after the vote"
    said = results[0][1]  # on rank 0, once per faulted case, naming the rank and the error
    assert len(said) == len(STRATEGIES) * (len(COMBOS) - len(HEALTHY)), said
    assert all(re.match(r"step 3: rank [01] raised ", line) for line in said), said
    # zero1's optimizer.zero_grad(), in the loop's handler, is where that rank made up its step
    assert said[len(COMBOS) - len(HEALTHY)].startswith(
        "step 3: rank 1 raised OutOfMemoryError: CUDA out of memory (simulated in backward). "
        "The step is dropped on every rank"), said
    assert results[1][1] == [], "only rank 0 says it"


def test_under_fp16_a_dropped_step_leaves_what_every_rank_skipping_the_batch_leaves():
    """fp16's loss scaler (phalanx's own): the step voted down neither moves the scale nor
    counts a good step; bitwise what a run whose every rank skipped that batch ends with."""
    combos = [("caught", "backward", 1), ("caught", "skip", None)]
    results = run_ranks(runs.cases, 2, args=(["ddp", "zero2", "zero3"], combos),
                        kwargs={"precision": "fp16"}, timeout=240)
    for rank, per_case in enumerate(results):
        for strategy in ["ddp", "zero2", "zero3"]:
            voted, _, scale = per_case[(strategy, combos[0])]
            skipped, _, want = per_case[(strategy, combos[1])]
            assert scale == want and want["good_steps"] == runs.STEPS - 1, (strategy, scale)
            assert all(torch.equal(a, b) for a, b in zip(voted, skipped)), (strategy, rank)


def _too_early():
    runs.BAD_STEP = 1  # zero3's second step: the gathers of the rest of it are not known yet
    return runs.train("zero3", "caught", "backward", 1)


def test_zero3_before_it_knows_the_rest_of_the_step_says_so_on_the_failing_rank():
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_too_early, 2, timeout=120)
    assert "rank 1 failed:\nRuntimeError: this rank's step raised (OutOfMemoryError: CUDA out " \
           "of memory (simulated in backward)) while the other ranks were in it, and it cannot " \
           "drop the step on every rank here: zero3 gathers in an order it has not settled " \
           "yet" in str(failed.value)


def _reasons():
    out = {}
    for name, options in [("sync_batchnorm", {"sync_batchnorm": True}),
                          ("staleness", {"staleness": 1}),
                          ("compression", {"compression": px.PowerSGD(rank=1)})]:
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = px.prepare(model, opt, **options)
        out[name] = engine_of(model).vote.blocker()
    return out


def test_where_the_rest_of_a_step_cannot_be_made_the_failing_rank_is_told_why():
    reasons = run_ranks(_reasons, 2, timeout=120)[0]
    assert reasons == {
        "sync_batchnorm": "the model's SyncBatchNorm layers make collectives of their own in "
                          "the forward and backward",
        "staleness": "staleness=1 applies each step's gradients at the next one",
        "compression": "gradient compression keeps error-feedback state on each rank that the "
                       "dropped step would still change"}


def _closure_forward_raises_on_rank1():
    """Lightning's shape of loop: the forward and backward in a closure given to
    optimizer.step(); rank 1's forward raises at step 1 and the loop catches it."""
    at = {"step": 0}

    class Boom(nn.Module):
        def forward(self, x):
            if at["step"] == 1 and px.rank() == 1:
                raise ValueError("a bad batch")
            return x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Boom(), nn.ReLU(), nn.Linear(8, 1)).double()
    model, opt = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 4, dtype=torch.float64)

    def closure():
        loss = model(x).sum()
        loss.backward()
        return loss

    caught = []
    for step in range(3):
        at["step"] = step
        try:
            opt.step(closure)
        except ValueError as exc:
            caught.append(str(exc))
        opt.zero_grad()
    return caught, [p.detach().clone() for p in px.unwrap(model).parameters()]


def test_a_forward_that_raised_in_a_closure_is_voted_down_not_a_failed_step():
    (caught0, params0), (caught1, params1) = run_ranks(_closure_forward_raises_on_rank1, 2,
                                                       timeout=120)
    assert caught0 == [] and caught1 == ["a bad batch"], (caught0, caught1)
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)  # the replicas stayed the same


def _step_raises_on_rank1(strategy, with_closure):
    """Rank 1's optimizer.step() raises at step 1, the loop catches it, and each rank then
    calls into its model: what each call meets. Plain: the step's pre-hook raises (inside
    torch's step). With a closure doing the forward and backward, as Lightning's loop passes
    one: the step's post-hook raises (the forward and backward ran inside the step, and are
    no failure of it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy=strategy)
    x = torch.randn(4, 4, dtype=torch.float64)
    at = {"step": 0}

    def fault(*_):
        if at["step"] == 1 and px.rank() == 1:
            raise ValueError("a bug in the step")

    def closure():
        loss = model(x).sum()
        loss.backward()
        return loss

    if with_closure:
        opt.register_step_post_hook(fault)
    else:
        opt.register_step_pre_hook(fault)
    caught = None
    for step in range(2):
        at["step"] = step
        try:
            if with_closure:
                opt.step(closure)
            else:
                model(x).sum().backward()
                opt.step()
        except ValueError as exc:
            caught = str(exc)
        if px.rank() == 0:
            opt.zero_grad()
    if px.rank() == 0:
        return caught, None
    try:
        model(x)
    except px.StepFailed as exc:
        return caught, str(exc)
    return caught, "model(x) went on"


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
@pytest.mark.parametrize("with_closure", [False, True], ids=["plain", "closure"])
def test_a_step_that_raised_inside_the_optimizer_stops_that_rank_at_its_next_call(
        strategy, with_closure):
    """[Note: a step that raised in the optimizer] in engine/vote.py: the others are past the
    step, so the rank that raised cannot train on; a closure run inside a healthy step (the
    forward and backward in the middle of optimizer.step) is no failure."""
    first, second = run_ranks(_step_raises_on_rank1, 2, args=(strategy, with_closure),
                              timeout=120)
    assert first == (None, None), first
    caught, then = second
    assert caught == "a bug in the step", second
    assert then.startswith("this rank's optimizer.step() at step 1 raised (ValueError: a bug "
                           "in the step)"), then


# -- under the launcher --------------------------------------------------------------------------
_references: dict = {}


def _reference(tmp_path, skip: int) -> torch.Tensor:
    """The script in a world of one (plain python) that leaves out step `skip`'s batch."""
    if skip not in _references:
        out = tmp_path / f"reference{skip}.pt"
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
        subprocess.run([sys.executable, str(SCRIPT), str(out), "--skip", str(skip)],
                       check=True, env=env, timeout=120, capture_output=True)
        _references[skip] = torch.load(out)
    return _references[skip]


def _lines(stdout: str, tag: str) -> list[dict]:
    return [dict(field.split("=") for field in fields.split())
            for fields in re.findall(rf"^\[rank\d+\]: {tag} (.*)$", stdout, re.MULTILINE)]


@pytest.mark.parametrize("strategy,loop,where,mode", [
    ("ddp", "caught", "backward", "continue"),
    pytest.param("zero2", "outer", "backward", "continue", marks=pytest.mark.slow),
    pytest.param("zero3", "caught", "forward", "continue", marks=pytest.mark.slow),
    pytest.param("zero1", "outer", "forward", "restart", marks=pytest.mark.slow)])
def test_under_the_launcher_nobody_is_removed_and_the_batch_is_skipped(
        tmp_path, strategy, loop, where, mode):
    """Rank 1 fails in the last step of the first epoch: under continue mode the samplers'
    ledgers (data/ledger.py) are checked at that pass's end and at the job's."""
    out = tmp_path / "out.pt"
    result = subprocess.run(
        [sys.executable, "-m", "phalanx", "run", "-n", "3", "--on-failure", mode, str(SCRIPT),
         str(out), "--strategy", strategy, "--loop", loop, "--where", where, "--fault", "1@3"],
        check=False, capture_output=True, text=True, timeout=240,
        env=dict(os.environ, PHALANX_RUN_DIR=str(tmp_path / "run")))
    assert result.returncode == 0, result.stderr[-4000:]
    assert (torch.load(out) - _reference(tmp_path, 3)).abs().max().item() < 1e-12
    starts, ends = _lines(result.stdout, "START"), _lines(result.stdout, "END")
    assert len(starts) == 3 and sorted((e["rank"], e["pid"]) for e in ends) == \
        sorted((s["rank"], s["pid"]) for s in starts), result.stdout  # the same processes
    assert {e["world"] for e in ends} == {"3"} and {e["steps"] for e in ends} == {"7"}
    assert "step 3: rank 1 raised" in result.stderr, result.stderr[-4000:]
    assert not re.search(r"phalanx: rank \d (was|joined)|redone|skipped by", result.stderr)
    assert processes_running(str(out)) == []
