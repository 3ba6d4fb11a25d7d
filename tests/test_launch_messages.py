"""`phalanx run`'s message names the rank that made the others fail: one that hung (frozen, or
still there after the launcher's SIGTERM) or that left early (its script ended while the others
went on), not the signal the launcher sent it in its own cleanup.

The jobs are `phalanx run -n 2` of tests/launch_scripts/misbehave.py, rank 1 misbehaving at
step 3, in a subprocess with a timeout; PHALANX_HANG_AFTER=3 makes the hang report come after
3 s of waiting. The report's own wording is faults/hangs.py's (tests/test_hangs.py); here, the
launcher's lead and what it says of each rank. The rest are the message's rules, on failures
made by hand (no job).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from phalanx.launch import failures
from phalanx.launch.cleanup import Ending, note_signals

SCRIPT = Path(__file__).parent / "launch_scripts" / "misbehave.py"


def run_job(tmp_path, kind: str, *extra, hang_after: str | None = "3", timeout: float = 120):
    """`hang_after` None: PHALANX_HANG_AFTER unset (the report after 200 s, a third of
    px.init's default timeout)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_HANG_AFTER"}
    if hang_after is not None:
        env["PHALANX_HANG_AFTER"] = hang_after
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(SCRIPT),
                             kind, str(pids), *extra], capture_output=True, text=True,
                            timeout=timeout, env=env, check=False)
    took = time.monotonic() - start
    for path in pids.iterdir():  # nothing left behind, stopped or not
        pid = int(path.read_text())
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        assert state == "Z", f"{path.name} (pid {pid}) is still there, state {state}"
    return result, took


def summary(result) -> list[str]:
    err = result.stderr
    assert "phalanx run: error: " in err, err
    return err[err.index("phalanx run: error: "):].splitlines()


def test_a_frozen_rank_is_named_as_hung_not_as_killed(tmp_path):
    # The case: rank 1 SIGSTOPped; the job ended with "rank 1 was killed by SIGKILL",
    # the launcher's own SIGKILL after 30 s of a SIGTERM the frozen process never received.
    result, _ = run_job(tmp_path, "freeze")
    assert result.returncode == 1 and "DONE" not in result.stdout, result.stderr
    lines = summary(result)
    assert lines[0] == ("phalanx run: error: rank 1 hung: its process was frozen (stopped, as "
                        "by SIGSTOP), and the launcher ended it"), result.stderr
    assert lines[1].startswith("  | rank 0 exited with code 124: hang at step 3: rank 1 has "
                               "not entered all_reduce #"), result.stderr
    assert "SIGKILL" not in result.stderr
    assert "stopped: rank 1" not in result.stderr


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero2", marks=pytest.mark.slow),
                                      pytest.param("zero3", marks=pytest.mark.slow)])
def test_a_frozen_rank_zero_is_named_too(tmp_path, strategy):
    """Rank 0 SIGSTOPped at step 3: its worker serves the job's store, whose client waits for
    an answer with no bound, so rank 1's hang watcher froze in its first look at the store and
    nothing was said until the probe gave up (220 s). Now rank 1 says what it knows once its
    collective has waited past the threshold and the store has not answered, and the launcher
    names rank 0 as hung ([Note: a store that does not answer] in faults/store_calls.py)."""
    result, took = run_job(tmp_path, "freeze0", "-", strategy)
    assert result.returncode == 1 and "DONE" not in result.stdout, result.stderr
    lines = summary(result)
    assert lines[0] == ("phalanx run: error: rank 0 hung: its process was frozen (stopped, as "
                        "by SIGSTOP), and the launcher ended it"), result.stderr
    assert re.match(r"  \| rank 1 exited with code 124: hang at step 3: rank 1 has waited "
                    r"[0-9.]+ s in .*, and the job's store has not answered for \d+ s",
                    lines[1]), result.stderr


def test_a_frozen_worker_receives_the_launchers_signal_at_once():
    # torch's agent sends SIGTERM, then SIGKILL 30 s later to what is still there; a frozen
    # process receives neither until continued, so the launcher continues it.
    class Handler:  # torch's SubprocessHandler, as far as the agent's cleanup uses it
        def __init__(self):
            self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                         start_new_session=True)

        def close(self, death_sig=None):
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)

    handler, ending = Handler(), Ending()
    try:
        note_signals(handler, ending)
        os.kill(handler.proc.pid, signal.SIGSTOP)
        while Path(f"/proc/{handler.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] \
                != "T":
            time.sleep(0.01)
        handler.close(signal.SIGTERM)
        assert handler.proc.wait(timeout=20) == -signal.SIGTERM
    finally:
        handler.proc.kill()
        handler.proc.wait()
    assert ending.frozen and ending.signals == ["SIGTERM"] and ending.hung


def test_a_rank_whose_script_ends_early_is_named_as_leaving_early(tmp_path):
    # The case: rank 1 calls sys.exit(0) at step 3 while rank 0 goes on. With the
    # default threshold (200 s): a collective that waits on a rank at its end is reported
    # after a few polls, since that rank will never come.
    result, took = run_job(tmp_path, "exit", hang_after=None)
    assert result.returncode == 1 and "DONE" not in result.stdout, result.stderr
    lines = summary(result)
    assert lines[0] == ("phalanx run: error: rank 1 left early (the script called sys.exit(0) "
                        "after 3 optimizer steps), while the other ranks went on and waited "
                        "for it"), result.stderr
    assert lines[1].startswith("  | rank 0 exited with code 124: hang at step 3: rank 1 has "
                               "not entered all_reduce #"), result.stderr
    assert lines[1].endswith("; rank 1 has reached its end (the script called sys.exit(0) at "
                             "step 3): it left early"), result.stderr
    assert not any(line.startswith("  stopped:") for line in lines), result.stderr
    assert took < 100, took  # half the threshold: interpreters starting, 3 steps, 3 polls


def test_a_shutdown_that_raises_at_the_end_of_the_script_fails_the_job(tmp_path):
    # px.shutdown(), called by the end of the script, raised (continue mode's check that the
    # model holds what the loop took does): the worker printed it and exited 0, and the job
    # completed.
    script = tmp_path / "shutdown_raises.py"
    script.write_text(
        "import phalanx as px\n"
        "from phalanx.world import runtime\n\n"
        "def check():\n"
        "    raise RuntimeError('the counts differ (simulated)')\n\n"
        "px.init()\n"
        "runtime.before_shutdown(check)  # px.shutdown() raises it once the groups are ended\n"
        "print('TRAINED', flush=True)\n")
    result = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(script)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1 and result.stdout.count("TRAINED") == 2, result.stderr
    for rank in (0, 1):
        assert f"[rank{rank}]: phalanx: rank {rank}: px.shutdown() at the end of the script " \
               "failed: RuntimeError: the counts differ (simulated)" in result.stderr
    assert re.fullmatch(r"phalanx run: error: rank [01] exited with code 1: px\.shutdown\(\) at "
                        r"the end of the script failed: RuntimeError: the counts differ "
                        r"\(simulated\)", summary(result)[0]), result.stderr


@pytest.mark.slow  # torch's agent waits 30 s after SIGTERM before its SIGKILL
def test_a_rank_that_does_not_end_on_sigterm_is_named_as_hung(tmp_path):
    # No hang report: rank 0 fails at the collective timeout (5 s), and rank 1, asleep with
    # SIGTERM ignored, is killed by the launcher 30 s after its SIGTERM.
    result, _ = run_job(tmp_path, "stuck", "5", hang_after="off", timeout=180)
    assert result.returncode == 1, result.stderr
    lines = summary(result)
    assert lines[0] == ("phalanx run: error: rank 1 hung: it did not end within 30 s of the "
                        "launcher's SIGTERM (stuck in native code, or ignoring SIGTERM), and "
                        "the launcher killed it (SIGKILL)"), result.stderr
    assert lines[1].startswith("  | rank 0 exited with code 1: "), result.stderr
    assert "was killed by SIGKILL" not in result.stderr


# -- the message's rules, on failures made by hand -------------------------------------------
def _attempt(tmp_path, outcomes: dict, ended: dict = ()) -> dict:
    """Failures as the agent hands them over, with each rank's log folder as it leaves them:
    `outcomes` rank -> (exit code, first line of its stderr); `ended`: rank -> ended.json."""
    attempt = tmp_path / "phalanx_x" / "attempt_0"
    out = {}
    for rank, (code, said) in outcomes.items():
        folder = attempt / str(rank)
        folder.mkdir(parents=True)
        (folder / "stderr.log").write_text(said + "\n")
        if code:
            out[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code,
                                       error_file=str(folder / "error.json"))
    for rank, record in dict(ended).items():
        (attempt / str(rank) / "ended.json").write_text(json.dumps(record))
    return out


@pytest.mark.one_process
def test_a_kill_by_someone_else_is_still_a_kill(tmp_path):
    got = _attempt(tmp_path, {0: (-signal.SIGKILL, ""), 1: (-signal.SIGTERM, "")})
    endings = {0: Ending(), 1: Ending(signals=["SIGTERM"])}
    report = failures.failure_report(got, str(tmp_path), endings=endings)
    assert report.splitlines() == ["phalanx run: error: rank 0 was killed by SIGKILL",
                                   "  stopped: rank 1"]


@pytest.mark.one_process
def test_the_launchers_own_sigkill_leads_as_a_hang_and_then_the_failure_it_caused(tmp_path):
    got = _attempt(tmp_path, {0: (1, "RuntimeError: Timed out waiting 5000ms for recv"),
                              1: (-signal.SIGKILL, "")})
    endings = {0: Ending(), 1: Ending(signals=["SIGTERM", "SIGKILL"])}
    report = failures.failure_report(got, str(tmp_path), endings=endings).splitlines()
    assert report[0].startswith("phalanx run: error: rank 1 hung: it did not end within 30 s")
    assert report[1].startswith("  | rank 0 exited with code 1")
    assert "also failed" not in "\n".join(report) and "stopped" not in "\n".join(report)
    line = failures.restart_line(got, str(tmp_path), 2, 3, endings)
    assert line.startswith("phalanx run: rank 1 hung: it did not end within 30 s") and \
        line.endswith("; restarting workers (attempt 2 of 3)")


@pytest.mark.one_process
def test_an_early_end_is_the_cause_only_of_a_failure_that_waited_for_it(tmp_path):
    ended = {0: {"how": "the script ended", "step": 1, "time": 0.0}}
    # rank 1 lost its peer: rank 0, which had ended, left early
    lost = _attempt(tmp_path / "a", {0: (-signal.SIGTERM, ""),
                                     1: (1, "RuntimeError: Connection closed by peer")}, ended)
    lead = failures.failure_report(lost, str(tmp_path / "a")).splitlines()[0]
    assert lead == ("phalanx run: error: rank 0 left early (the script ended after 1 optimizer "
                    "step), while the other ranks went on and waited for it")
    # rank 1 raised an error of its own after rank 0 had finished: that error leads
    own = _attempt(tmp_path / "b", {0: (0, ""), 1: (1, "ValueError: bad batch")}, ended)
    lead = failures.failure_report(own, str(tmp_path / "b")).splitlines()[0]
    assert lead == "phalanx run: error: rank 1 exited with code 1"
