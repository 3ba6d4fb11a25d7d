"""`phalanx run --on-failure continue`: training goes on through a failure without a restart.

Every job is a real `phalanx run` of tests/launch_scripts/keep_going.py (float64, an epoch loop
over px.data_loader, a px.save after every step, the README's resume lines), with a timeout.
The reference is the same script in a world of one. A rank killed at any moment must leave the
survivors (the same processes, start to end) with the uninterrupted run's weights, the step in
flight redone over fewer ranks; its replacement joins at a save and the job ends at full size.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import phalanx as px

from test_launch import phalanx, processes_running

SCRIPT = Path(__file__).parent / "launch_scripts" / "keep_going.py"
TIMEOUT = 240


_references: dict = {}


def _reference(tmp_path, *extra) -> torch.Tensor:
    """The same training in a world of one (plain python), run once per extra arguments."""
    key = tuple(map(str, extra))
    if key not in _references:
        out = tmp_path / f"reference{'-'.join(key)}.pt"
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
        subprocess.run([sys.executable, str(SCRIPT), str(out), str(tmp_path / "ref-ckpt"), *key],
                       check=True, env=env, timeout=TIMEOUT, capture_output=True)
        _references[key] = torch.load(out)
    return _references[key]


def _lines(stdout: str, tag: str) -> list[dict]:
    return [dict(field.split("=") for field in fields.split())
            for fields in re.findall(rf"^\[rank\d+\]: {tag} (.*)$", stdout, re.M)]


def _job(tmp_path, *extra, n=3, restarts=3, kill_from_outside=0, seed=0):
    """Run the script under `--on-failure continue`; `kill_from_outside` random workers are
    SIGKILLed at random moments once training runs. Returns (weights, stdout, stderr); the
    checkpoint directory is `_job.ckpt`."""
    token = f"keep-going-{random.Random().getrandbits(64):x}"
    ckpt, out = tmp_path / f"ckpt-{token}", tmp_path / f"out-{token}.pt"  # never an older job's
    _job.ckpt = ckpt
    cmd = [sys.executable, "-m", "phalanx", "run", "-n", str(n), "--on-failure", "continue",
           "--max-restarts", str(restarts), str(SCRIPT), str(out), str(ckpt), *map(str, extra)]
    env = dict(os.environ, PHALANX_RUN_DIR=str(tmp_path / f"run-{token}"))
    _job.run_dir = Path(env["PHALANX_RUN_DIR"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    rng = random.Random(seed)
    try:
        for _ in range(kill_from_outside):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # training, with no replacement starting
                latest = [p for p in ckpt.glob("step*") if ".partial" not in p.name]
                workers = [int(line.split(":")[0]) for line in processes_running(str(ckpt))
                           if "phalanx.launch.worker" in line]
                if latest and len(workers) == n:
                    break
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.4))  # anywhere in a step: forward ... save
            os.kill(rng.choice(workers), signal.SIGKILL)
            time.sleep(0.5)
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert processes_running(str(ckpt)) == []
    return torch.load(out), stdout, stderr


def _survivors_kept_their_processes(stdout: str, n: int) -> None:
    """Every first worker that ended, ended in the process it started in, and nobody else of
    its rank started but replacements (life > 0)."""
    starts, ends = _lines(stdout, "START"), _lines(stdout, "END")
    first = {s["rank"]: s["pid"] for s in starts if s["life"] == "0"}
    assert sorted(first) == [str(r) for r in range(n)], stdout
    for end in ends:
        if end["life"] == "0":
            assert end["pid"] == first[end["rank"]], stdout


def _close(a: torch.Tensor, b: torch.Tensor, stderr: str = "") -> None:
    """Within 1e-10; else the difference and what phalanx said of the job."""
    said = "\n".join(line for line in stderr.splitlines()
                     if line.startswith(("phalanx", "[rank")) and "Warning" not in line)
    assert (a - b).abs().max().item() < 1e-10, f"{(a - b).abs().max().item()}\n{said[-4000:]}"


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero2", marks=pytest.mark.slow),
                                      pytest.param("zero3", marks=pytest.mark.slow)])
def test_a_rank_killed_mid_step_is_redone_by_the_others_and_its_replacement_joins(
        tmp_path, strategy):
    reference = _reference(tmp_path)
    # the survivors wait at step 12 for the replacement to ask (an event, not a clock: on a
    # loaded machine it once started only after the job had ended)
    weights, stdout, stderr = _job(tmp_path, "--kill", "1@7", "--sleep", "0.05",
                                   "--wait-for-joiner", "12", "--strategy", strategy)
    _close(weights, reference)
    _survivors_kept_their_processes(stdout, 3)
    assert "phalanx: rank 1 was killed by SIGKILL at step 7; step 7 redone by 2 ranks" in stderr
    assert re.search(r"phalanx: rank 1 joined at step \d+ \(replacement 1\): 3 ranks", stderr)
    ends = _lines(stdout, "END")
    assert sorted(e["rank"] for e in ends) == ["0", "1", "2"] and \
        {e["world"] for e in ends} == {"3"}, stdout  # full size again, the replacement in
    assert "going on through 1 failure: rank 1 was killed by SIGKILL" in stderr
    # each change is an entry in the next step's report on every rank, and a metrics row
    events = _lines(stdout, "EVENT")
    left = [e for e in events if "membership/left" in e]
    joined = [e for e in events if "membership/joined" in e]
    assert {(e["membership/world"], e["membership/step"]) for e in left} == {("2", "7")}, stdout
    assert len(left) == 2 and len(joined) == 2, stdout  # on each of the two that went on
    metrics = (_job.run_dir / "metrics.csv").read_text()
    assert re.search(r"^7,membership/left,1,", metrics, re.M), metrics
    assert "membership/joined" in metrics


@pytest.mark.parametrize("strategy", ["zero2", pytest.param("zero3", marks=pytest.mark.slow)])
def test_a_rank_killed_in_the_save_after_an_epochs_last_step_loses_no_epoch(tmp_path, strategy):
    """Rank 2 killed in the px.save after the last step of epoch 1 (step 39): the others see
    it in that save, and in the first step of epoch 2 go back to step 39's checkpoint, whose
    sampler stands in epoch 1 while the loop's `for` is in epoch 2. That iteration must serve
    the rest of epoch 1 and then all of epoch 2 (it once ended after one batch: a whole epoch
    lost, and the job completed)."""
    reference = _reference(tmp_path)
    weights, _, stderr = _job(tmp_path, "--die-in-save", "2@39", "--strategy", strategy,
                              restarts=2)
    _close(weights, reference, stderr)
    assert "rank 2 was killed by SIGKILL at step 40; step 40 redone by 2 ranks from " \
           "step00039" in stderr


@pytest.mark.slow
def test_a_step_lost_after_the_loop_ended_fails_the_job_with_the_ledgers_counts(tmp_path):
    """Killed in the save after the very last step under zero2: the others go back to the
    checkpoint before it, and no loop is left to train that step again. The job ends with
    an error that says what is missing ([Note: the ledger]), not as completed."""
    token = f"keep-going-{random.Random().getrandbits(64):x}"
    result = phalanx("run", "-n", 3, "--on-failure", "continue", "--max-restarts", 2, SCRIPT,
                     tmp_path / "o.pt", tmp_path / token, "--strategy", "zero2",
                     "--die-in-save", "2@59", timeout=TIMEOUT)
    assert result.returncode == 1, result.stderr
    assert "MembershipError: phalanx: at the end of the job, the model does not hold what the " \
           "loop was served after a recovery from a lost rank: epoch 2: the loop took 240 " \
           "samples in 20 optimizer steps, the model holds 228 samples in 19 optimizer " \
           "steps" in result.stderr
    assert "the job completed" not in result.stderr
    assert processes_running(token) == []


@pytest.mark.slow
@pytest.mark.parametrize("fault,strategy,reference,line", [
    ("--kill", "zero3", (), "rank 2 was killed by SIGKILL at step 10; step 10 redone by 2 ranks"),
    ("--raise", "zero2", ("--skip", 10), "step 10 skipped by 2 ranks")], ids=["kill", "raise"])
def test_a_sharded_job_saving_every_few_steps_goes_back_to_its_last_checkpoint(
        tmp_path, fault, strategy, reference, line):
    """A save every 4 steps, rank 2 killed (or raising) in step 10: the survivors load step
    8's checkpoint (the lost shard is nowhere else) and train steps 8 and 9 again, on the same
    samples; step 10 is then redone (or its batch left out), so the weights end as the
    uninterrupted run's (or as a run that skipped that batch)."""
    expected = _reference(tmp_path, *reference)
    weights, stdout, stderr = _job(tmp_path, fault, "2@10", "--strategy", strategy,
                                   "--save-every", 4, restarts=0)
    _close(weights, expected)
    assert line in stderr


@pytest.mark.slow
def test_a_sharded_job_that_saved_nothing_cannot_go_on_and_says_why(tmp_path):
    token = f"keep-going-{random.Random().getrandbits(64):x}"
    result = phalanx("run", "-n", 3, "--on-failure", "continue", SCRIPT, tmp_path / "o.pt",
                     tmp_path / token, "--strategy", "zero2", "--kill", "1@3",
                     "--save-every", 1000, timeout=TIMEOUT)
    assert result.returncode == 1
    assert "its shard of the model's state is nowhere but in a checkpoint: the job has none" \
        in result.stderr
    assert processes_running(token) == []


@pytest.mark.slow
@pytest.mark.parametrize("kill", [
    "0@0",        # rank 0 (the line's speaker), the first step
    "2@19",       # the last step of an epoch
    "1@3,2@25",   # two failures in one job
])
def test_kills_at_chosen_steps_end_as_the_uninterrupted_run(tmp_path, kill):
    reference = _reference(tmp_path)
    weights, stdout, stderr = _job(tmp_path, "--kill", kill, "--sleep", "0.05")
    _close(weights, reference)
    _survivors_kept_their_processes(stdout, 3)
    assert stderr.count("was killed by SIGKILL at step") == kill.count("@"), stderr


@pytest.mark.slow
def test_two_failures_and_no_replacements_leave_one_rank_training_alone(tmp_path):
    reference = _reference(tmp_path)
    weights, stdout, stderr = _job(tmp_path, "--kill", "0@4,2@9", restarts=0)
    _close(weights, reference)
    ends = _lines(stdout, "END")
    assert [(e["rank"], e["world"]) for e in ends] == [("1", "1")], stdout
    assert "step 9 redone by 1 rank" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_rank_killed_at_random_moments_from_outside(tmp_path, strategy):
    """The issue's test: SIGKILL at a random moment of a random step (forward, backward, the
    vote, the optimizer, the save), from outside the job, 10 times per strategy."""
    reference = _reference(tmp_path)
    for seed in range(10):
        weights, stdout, stderr = _job(tmp_path, "--sleep", "0.05", "--strategy", strategy,
                                       kill_from_outside=1, seed=seed)
        _close(weights, reference, f"seed {seed}\n{stderr}")
        _survivors_kept_their_processes(stdout, 3)
        assert stderr.count("was killed by SIGKILL at step") == 1, stderr


@pytest.mark.slow
@pytest.mark.parametrize("fault,strategy,who", [
    (["--die-in-save", "2@6"], "ddp", 2),   # writing its file
    # rank 0 as it completes the checkpoint: the others wait for its word in an object
    # gather, whose lengths once came back unfilled and were read as garbage
    (["--die-completing", "6"], "zero3", 0),
], ids=["writing", "completing"])
def test_a_rank_killed_while_saving_leaves_no_checkpoint_behind_and_training_exact(
        tmp_path, fault, strategy, who):
    reference = _reference(tmp_path)
    weights, stdout, stderr = _job(tmp_path, *fault, "--sleep", "0.05", "--strategy", strategy)
    _close(weights, reference)
    # step 6 committed before its save: the step lost is the next one
    assert f"rank {who} was killed by SIGKILL at step 7; step 7 redone by 2 ranks" in stderr
    assert "wrote nothing: a rank was lost during this step" in stderr
    left = sorted(p.name for p in _job.ckpt.iterdir())
    assert all(px.latest_checkpoint(_job.ckpt) and (_job.ckpt / name / "manifest.json").exists()
               for name in left), left  # complete checkpoints only, nothing half written


@pytest.mark.parametrize("fault", [
    pytest.param(["--die-joining"], marks=pytest.mark.slow),  # the replacement, loading
    pytest.param(["--die-admitting", "2"], marks=pytest.mark.slow),  # another, admitting it
])
def test_a_failure_during_the_catch_up(tmp_path, fault):
    reference = _reference(tmp_path)
    weights, stdout, stderr = _job(tmp_path, "--kill", "1@3", "--sleep", "0.08", *fault)
    _close(weights, reference)
    assert stderr.count("was killed by SIGKILL at step") == 2, stderr


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero2", marks=pytest.mark.slow),
                                      pytest.param("zero3", marks=pytest.mark.slow)])
def test_an_exception_in_one_ranks_backward_skips_that_batch_on_every_rank(tmp_path, strategy):
    skipped = _reference(tmp_path, "--skip", 7)
    weights, stdout, stderr = _job(tmp_path, "--raise", "2@7", "--sleep", "0.05",
                                   "--strategy", strategy, restarts=0)
    _close(weights, skipped)
    assert "phalanx: rank 2 raised RuntimeError: CUDA out of memory (simulated) at step 7; " \
           "step 7 skipped by 2 ranks" in stderr
    assert "[rank2]: RuntimeError: CUDA out of memory (simulated)" in stderr  # its traceback


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_an_exception_in_an_epochs_last_step_skips_only_that_batch(tmp_path, strategy):
    """The step after the skipped one is the next epoch's first: the survivors' pass of epoch
    0 must end there (it once served all of epoch 1 inside it, then epoch 1 again)."""
    skipped = _reference(tmp_path, "--skip", 19)
    weights, _, stderr = _job(tmp_path, "--raise", "2@19", "--strategy", strategy, restarts=0)
    _close(weights, skipped, stderr)
    assert "at step 19; step 19 skipped by 2 ranks" in stderr


@pytest.mark.slow
def test_a_replacement_without_resume_lines_cannot_join_and_the_job_goes_on(tmp_path):
    reference = _reference(tmp_path)
    weights, stdout, stderr = _job(tmp_path, "--kill", "2@3", "--no-resume", "--sleep", "0.05")
    _close(weights, reference)
    assert "the replacement of rank 2 cannot join: the script trains before any" in stderr


@pytest.mark.slow
def test_unsupported_options_are_refused_on_every_rank(tmp_path):
    result = phalanx("run", "-n", 2, "--on-failure", "continue", SCRIPT, tmp_path / "o.pt",
                     tmp_path / "ck", "--precision", "fp16")
    assert result.returncode == 1
    assert "--on-failure continue: precision='fp16' is not supported yet" in result.stderr
    assert result.stderr.count("is not supported yet") >= 2  # every rank said it


@pytest.mark.slow
def test_stop_ends_at_the_first_failure_and_refuses_restarts(tmp_path):
    result = phalanx("run", "-n", 2, "--on-failure", "stop", "--max-restarts", 2, SCRIPT,
                     tmp_path / "o.pt", tmp_path / "ck")
    assert result.returncode == 2 and "--on-failure stop ends the job at the first" in result.stderr
    result = phalanx("run", "-n", 2, "--on-failure", "stop", SCRIPT, tmp_path / "o.pt",
                     tmp_path / "ck", "--kill", "1@2")
    assert result.returncode == 1
    assert "phalanx run: error: rank 1 was killed by SIGKILL" in result.stderr


@pytest.mark.parametrize("catch", [False, True], ids=["uncaught", "caught"])
def test_an_exception_inside_optimizer_step_redoes_the_steps_after_it(tmp_path, catch):
    """Rank 2's step pre-hook raises inside step 7's optimizer.step(), after its vote: the
    others applied step 7 with its gradients. Uncaught, it ended its worker and the survivors
    then skipped step 8, a healthy step (the job equalled neither skipping step 7 nor the
    uninterrupted run); caught by the loop, it trained on with parameters the others' step had
    left behind. Now the rank ends (caught: at its next call into the model, with StepFailed)
    and the steps after 7 are redone by the others: the uninterrupted run, exactly."""
    reference = _reference(tmp_path)
    extra = ("--catch",) if catch else ()
    weights, stdout, stderr = _job(tmp_path, "--raise", "2@7", "--raise-in", "step",
                                   "--sleep", "0.05", *extra, restarts=0)
    _close(weights, reference, stderr)
    assert "skipped by" not in stderr, stderr
    if catch:
        assert "StepFailed: this rank's optimizer.step() at step 7 raised (RuntimeError: CUDA " \
               "out of memory (simulated))" in stderr, stderr
