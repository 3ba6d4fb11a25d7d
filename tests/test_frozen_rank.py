"""A frozen rank (SIGSTOP) under every `--on-failure` mode: the job goes on without it or ends,
within a bound, and nothing is left behind, ever.

The jobs are real `phalanx run`s of tests/launch_scripts/keep_going.py (float64, 3 ranks, a
px.save after every step) with rank 1 stopping its own process before a chosen step, and
PHALANX_HANG_AFTER=3, so the hang report comes after 3 s of waiting. Under `continue` the
report's rank is removed (its agent ends it) and the others go on as after a kill
([Note: a member that hangs] in continuing/membership.py): the weights end as the uninterrupted
run's. A job that cannot go on, and the other modes, end with one message; a launcher that is
itself killed takes its workers with it ([Note: no worker outlives its launcher]).
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
from test_keep_going import (
    SCRIPT,
    TIMEOUT,
    _close,
    _job,
    _lines,
    _reference,
    _survivors_kept_their_processes,
)
from test_launch import processes_running

MISBEHAVE = Path(__file__).parent / "launch_scripts" / "misbehave.py"


@pytest.fixture(autouse=True)
def _report_after_3_s(monkeypatch):
    monkeypatch.setenv("PHALANX_HANG_AFTER", "3")


@pytest.mark.slow  # 43 s; benchmarks/fault_soak.py deals frozen ranks under continue too
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_frozen_rank_is_removed_and_the_others_go_on_as_after_a_kill(tmp_path, strategy):
    # The case: ranks 0 and 2 reported the hang and ended with status 124, the agent
    # started replacements for them, and they waited for an admission that the frozen rank 1
    # could never give: the job was still running at 300 s, and left rank 1 stopped behind.
    reference = _reference(tmp_path)
    weights, stdout, stderr = _job(tmp_path, "--freeze", "1@5", "--sleep", "0.1",
                                   "--strategy", strategy, restarts=1)  # no leftovers: _job
    _close(weights, reference, stderr)
    _survivors_kept_their_processes(stdout, 3)
    assert "phalanx: hang at step 5: rank 1 has not entered " in stderr, stderr
    assert "phalanx: rank 1 is removed from the job (the launcher ends it); the others go on " \
           "without it, as after a failure" in stderr, stderr
    assert "phalanx: rank 1 hung and was removed by the launcher (its process was frozen: " \
           "stopped, as by SIGSTOP) at step 5; step 5 redone by 2 ranks" in stderr, stderr
    assert "exit status 124" not in stderr, stderr  # nobody ended on the report
    assert any(s["rank"] == "1" and s["life"] == "1" for s in _lines(stdout, "START")), stdout
    assert stderr.rstrip().endswith(
        "phalanx run: the job completed, going on through 1 failure: rank 1 hung: its process "
        "was frozen (stopped, as by SIGSTOP); the hang report named it, and the launcher "
        "removed it"), stderr


def _run(tmp_path, *args, timeout=TIMEOUT):
    """`phalanx run -n 3 ARGS keep_going.py OUT CKPT ...`: (result, weights or None, token)."""
    token = f"frozen-{random.Random().getrandbits(64):x}"
    out, ckpt = tmp_path / f"{token}.pt", tmp_path / token
    split = args.index("--")
    cmd = [sys.executable, "-m", "phalanx", "run", "-n", "3", *map(str, args[:split]),
           str(SCRIPT), str(out), str(ckpt), *map(str, args[split + 1:])]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, PHALANX_RUN_DIR=str(tmp_path / "runs")))
    assert processes_running(token) == [], result.stderr  # a frozen rank, stopped or not
    return result, (torch.load(out) if out.exists() else None)


@pytest.mark.slow
def test_a_job_that_cannot_go_on_without_the_frozen_rank_ends_with_one_message(tmp_path):
    """zero2 with no checkpoint yet: the frozen rank is removed, and its shard is nowhere
    else. The survivors end with that error, and so does the job, failed: nobody is replaced
    after it (or a replacement already waiting to be admitted is ended)."""
    result, _ = _run(tmp_path, "--on-failure", "continue", "--max-restarts", 1, "--",
                     "--strategy", "zero2", "--save-every", 1000, "--freeze", "1@3")
    err = result.stderr
    assert result.returncode == 1, err
    assert "phalanx: rank 1 is removed from the job" in err, err
    summary = err[err.index("phalanx run: error: "):]
    assert re.search(r"rank [02] exited with code 1: MembershipError: phalanx: a rank was lost "
                     r"under a sharded strategy", summary), err  # the first survivor to fail
    # the lead, or the failure the job went on through before that one
    assert "rank 1 hung: its process was frozen (stopped, as by SIGSTOP); the hang report " \
           "named it, and the launcher removed it" in summary, err
    assert err.count("phalanx run: error: ") == 1 and "the job completed" not in err, err


@pytest.mark.slow
def test_under_restart_a_frozen_rank_is_ended_and_the_job_restarts_from_its_checkpoint(
        tmp_path):
    reference = _reference(tmp_path)
    result, weights = _run(tmp_path, "--on-failure", "restart", "--max-restarts", 1, "--",
                           "--freeze", "1@5")
    err = result.stderr
    assert result.returncode == 0, err
    assert "phalanx run: rank 1 hung: its process was frozen (stopped, as by SIGSTOP), and the " \
           "launcher ended it; restarting workers (attempt 2 of 2)" in err, err
    _close(weights, reference, err)


@pytest.mark.slow
def test_under_stop_a_frozen_rank_ends_the_job(tmp_path):
    result, _ = _run(tmp_path, "--on-failure", "stop", "--", "--freeze", "1@5")
    err = result.stderr
    assert result.returncode == 1, err
    assert err[err.index("phalanx run: error: "):].startswith(
        "phalanx run: error: rank 1 hung: its process was frozen (stopped, as by SIGSTOP), and "
        "the launcher ended it\n  | rank "), err


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.mark.slow
def test_a_launcher_killed_takes_its_workers_with_it_frozen_or_not(tmp_path):
    """No hang report (PHALANX_HANG_AFTER=off): rank 1 frozen, rank 0 waiting in a collective
    with it; the launcher is SIGKILLed. Both workers end with it (they lived on before: rank 1
    stopped for good)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "run", "-n", "2", str(MISBEHAVE), "freeze", str(pids)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, PHALANX_HANG_AFTER="off"))
    workers = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # both started, rank 1 frozen
            workers = [int(p.read_text()) for p in sorted(pids.glob("pid*")) if p.read_text()]
            if len(workers) == 2 and _state(workers[1]) == "T":
                break
            time.sleep(0.1)
        assert len(workers) == 2 and _state(workers[1]) == "T", workers
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_state(p) not in (None, "Z")
                                                  for p in workers):
            time.sleep(0.1)
        left = {p: _state(p) for p in workers if _state(p) not in (None, "Z")}
        assert left == {}, f"workers left behind (pid: state): {left}"
    finally:
        launcher.kill()
        for pid in workers:  # a test that fails leaves nothing either
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
