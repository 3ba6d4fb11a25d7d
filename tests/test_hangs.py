"""Hangs and mismatched collectives end with a message that names the rank and the collective.

Each job is `phalanx run -n 2` of tests/launch_scripts/hang.py in a subprocess with a timeout,
one rank misbehaving on purpose; PHALANX_HANG_AFTER=3 makes the report come after 3 s of
waiting, so no test waits for the process group's timeout. Each job is bounded by a limit in
seconds of an idle machine (tests/load_clock.py), which stretches with the machine's load.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import time
from pathlib import Path

import load_clock
import pytest

import phalanx as px
from phalanx.faults.hangs import HANG_EXIT, hang_threshold

SCRIPT = Path(__file__).parent / "launch_scripts" / "hang.py"
THRESHOLD = 3
# hang.py's px.init() takes the default timeout: without the report, a rank waiting in a
# collective its peer never joins waits that long (600 s)
JOB_TIMEOUT = inspect.signature(px.init).parameters["timeout"].default


def run_job(kind: str, strategy: str = "ddp", check: bool = False, limit: float = 90):
    """`phalanx run -n 2 hang.py KIND STRATEGY`, bounded by `limit` seconds of an idle
    machine; its result and how long it took (wall seconds)."""
    env = dict(os.environ, PHALANX_HANG_AFTER=str(THRESHOLD))
    if check:
        env["PHALANX_CHECK_COLLECTIVES"] = "1"
    start = time.monotonic()
    result = load_clock.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(SCRIPT),
                             kind, strategy], limit, env=env)
    return result, time.monotonic() - start


def test_a_sleeping_rank_is_named_with_the_collective_the_others_wait_in():
    # bounded by half the job's timeout: a job that waits it out fails (past the limit, or by
    # `took` below), however loaded the machine
    result, took = run_job("sleep", "zero2", limit=JOB_TIMEOUT / 2)
    assert result.returncode != 0
    assert "DONE" not in result.stdout
    err = result.stderr
    # rank 1 sleeps before step 3's forward; rank 0 waits in the first gradient bucket
    assert "phalanx: hang at step 3: rank 1 has not entered all_reduce #" in err, err
    assert "(unit[" in err and ":grads); rank 0 has waited" in err, err
    line = SCRIPT.read_text().splitlines().index("        time.sleep(600)") + 1
    assert f"hang.py:{line} in <module>: time.sleep(600)" in err, err  # rank 1's stack
    assert f"exited with code {HANG_EXIT}" in err, err
    # the launcher's summary leads with the report's headline
    summary = err[err.index("phalanx run: error:"):]
    assert "hang at step 3: rank 1 has not entered" in summary.splitlines()[0], summary
    # the report came once rank 0 had waited the threshold PHALANX_HANG_AFTER sets, not the
    # default one (a third of the timeout): both on the job's own clock, which the machine's
    # load delays but never shortens
    waited = float(re.search(r"rank 0 has waited ([0-9.]+) s in it", err).group(1))
    assert THRESHOLD <= waited < hang_threshold(JOB_TIMEOUT), waited
    # and it ended the job, from start to end (two interpreters starting included), long
    # before the process group's timeout would have: not a duration of the machine's speed,
    # the timeout's (no load stretches a job of a few seconds to half of 600 s)
    assert took < JOB_TIMEOUT / 2, took


@pytest.mark.slow  # the report's groups: test_zero3_observed.py names the gathers' group
def test_under_shard_size_the_report_names_the_group_and_its_ranks():
    """4 ranks as 2 groups of 2 (zero2, shard_size=2), rank 3 asleep: rank 2 waits for it in
    their group, ranks 0 and 1 for ranks 2 and 3 across groups. The report names the group
    missing a rank that waits nowhere, by its ranks (every group of a name differs by rank)."""
    env = dict(os.environ, PHALANX_HANG_AFTER=str(THRESHOLD))
    result = load_clock.run([sys.executable, "-m", "phalanx", "run", "-n", "4", str(SCRIPT),
                             "sleep", "zero2", "2"], 120, env=env)
    err = result.stderr
    assert result.returncode != 0 and "DONE" not in result.stdout, err
    # rank 3 is missing from two groups, its shard group and its replicas' group: the report
    # leads with either (both miss a rank that waits nowhere), naming the group by its ranks
    assert "hang at step 3: rank 3 has not entered all_reduce #" in err, err
    assert (":grads) on group 'hybrid:shards (ranks 2, 3)'; rank 2 has waited" in err
            or ":replicas) on group 'hybrid:replicas (ranks 1, 3)'; rank 1 has waited" in err), err
    # every rank's own wait is shown on its own group
    for group in ("hybrid:shards (ranks 2, 3)", "hybrid:replicas (ranks 0, 2)",
                  "hybrid:replicas (ranks 1, 3)"):
        assert f"on group '{group}'" in err, err


def test_a_rank_with_fewer_steps_is_named_with_both_collectives():
    result, _ = run_job("steps")
    assert result.returncode != 0
    err = result.stderr
    assert "hang at step 4: rank 1 has not entered all_reduce #" in err, err
    assert 'in shutdown: leaving.leave("px.shutdown")' in err, err  # rank 1 waits at its end
    assert "; rank 1 has reached its end (px.shutdown at step 4): it left early\n" in err, err


@pytest.mark.parametrize("kind", [pytest.param("skip", marks=pytest.mark.slow), "extra"])
def test_checked_collectives_name_what_each_rank_issues(kind):
    result, _ = run_job(kind, check=True)
    assert result.returncode != 0
    err = result.stderr
    assert "CollectiveMismatch: the ranks disagree on collective #" in err, err
    mine, theirs = ("rank 0", "rank 1") if kind == "skip" else ("rank 1", "rank 0")
    assert f"{mine} issues all_reduce (global_mean, 8 bytes) at step 4" in err, err
    assert f"{theirs} issues all_reduce (unit[0]:grads" in err, err


def test_a_healthy_run_with_a_short_threshold_is_not_reported():
    env = dict(os.environ, PHALANX_HANG_AFTER="1")
    script = Path(__file__).parent / "launch_scripts" / "train_and_exit.py"
    result = load_clock.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(script)],
                            90, env=env)
    assert result.returncode == 0, result.stderr
    assert "hang" not in result.stderr


@pytest.mark.one_process
def test_threshold_comes_from_the_timeout_or_the_environment(monkeypatch):
    monkeypatch.delenv("PHALANX_HANG_AFTER", raising=False)
    assert hang_threshold(600.0) == 200.0
    monkeypatch.setenv("PHALANX_HANG_AFTER", "7.5")
    assert hang_threshold(600.0) == 7.5
    monkeypatch.setenv("PHALANX_HANG_AFTER", "off")
    assert hang_threshold(600.0) is None
    monkeypatch.setenv("PHALANX_HANG_AFTER", "soon")
    with pytest.raises(ValueError, match="PHALANX_HANG_AFTER='soon': a positive number of "
                       "seconds"):
        hang_threshold(600.0)  # environment.py's parser: the message px.init gives first
