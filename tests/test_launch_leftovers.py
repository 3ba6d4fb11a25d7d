"""`phalanx run`'s temporary directory (`$TMPDIR/phalanx-run-*`, the workers' logs) does not
outlive its launcher for long: a launcher killed with SIGKILL cannot remove its own, and the
next `phalanx run` on the machine does, while the directory of a launcher still running beside
it is left alone (see [Note: a launcher's temporary directory] in launch/scratch.py); so
do `px.spawn`'s (`$TMPDIR/phalanx-workers-*`).

Real launchers (`python -m phalanx run` in subprocesses, each with a timeout) under a TMPDIR of
the test's own, a real SIGKILL; the test waits for events (a worker's pid file, a process's
end), never for a length of time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A worker that says it started (its pid) and waits for its go.
WAITER = """\
import os, sys, time
where, name = sys.argv[1], sys.argv[2]
with open(os.path.join(where, name + ".pid.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(where, name + ".pid.tmp"), os.path.join(where, name + ".pid"))
while not os.path.exists(os.path.join(where, "go-" + name)):
    time.sleep(0.05)
print("DONE", name, flush=True)
"""
TIMEOUT = 120  # seconds any one event may take (a launcher start imports torch)


def _wait_for(condition, what: str):
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"waited {TIMEOUT} s for {what}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _run_dirs(tmp: Path) -> set[str]:
    return {p.name for p in tmp.iterdir() if p.name.startswith("phalanx-run-")}


def _scene(tmp_path, name: str, text: str):
    """A TMPDIR of its own, a folder for the script's events, the script, and an environment
    without PHALANX_ settings that points TMPDIR there: (tmp, where, script, env)."""
    tmp, where, script = tmp_path / "tmp", tmp_path / "events", tmp_path / name
    tmp.mkdir()
    where.mkdir()
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env.update(TMPDIR=str(tmp))
    return tmp, where, script, env


@pytest.mark.slow  # two launches of 2 workers (PHALANX_SLOW=1); the spawner's twin stays
def test_the_next_run_removes_a_killed_launchers_directory_not_a_live_ones(tmp_path):
    tmp, where, script, env = _scene(tmp_path, "waiter.py", WAITER)
    env.update(PHALANX_RUN_DIR=str(tmp_path / "runs"))

    def launch(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "phalanx", "run", "-n", "1", str(script),
                                 str(where), name], cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    launchers, dirs = {}, {}
    try:
        for name in ("live", "killed"):  # one after the other, to know whose directory is whose
            before = _run_dirs(tmp)
            launchers[name] = launch(name)
            _wait_for((where / f"{name}.pid").exists, f"the {name} job's worker")
            (dirs[name],) = _run_dirs(tmp) - before
        worker = int((where / "killed.pid").read_text())
        launchers["killed"].kill()  # SIGKILL: the launcher's cleanup never runs
        launchers["killed"].communicate(timeout=TIMEOUT)
        assert launchers["killed"].returncode == -signal.SIGKILL
        _wait_for(lambda: not _alive(worker), "the killed launcher's worker to end")
        assert dirs["killed"] in _run_dirs(tmp)  # what the kill left behind

        quick = tmp_path / "quick.py"
        quick.write_text("print('QUICK', flush=True)\n")
        result = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "1", str(quick)],
                                cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=TIMEOUT, check=False)
        assert result.returncode == 0 and "QUICK" in result.stdout, result.stderr
        # the next run removed the dead launcher's directory, not the live one's, nor left its own
        assert _run_dirs(tmp) == {dirs["live"]}

        (where / "go-live").write_text("")
        out, err = launchers["live"].communicate(timeout=TIMEOUT)
        assert launchers["live"].returncode == 0 and "[rank0]: DONE live" in out, err
        assert _run_dirs(tmp) == set()  # a launcher that ends removes its own
    finally:
        for job in launchers.values():
            if job.poll() is None:
                job.kill()
                job.communicate()


SPAWNER = """\
import os, sys, time
import phalanx as px

def wait(where):
    open(os.path.join(where, f"rank{px.rank()}.started"), "w").close()
    while not os.path.exists(os.path.join(where, "go")):
        time.sleep(0.05)

px.spawn(wait, sys.argv[1], processes=1)
"""


def test_the_next_spawn_removes_a_killed_spawners_directory(tmp_path):
    """A script whose px.spawn is SIGKILLed leaves `phalanx-workers-*`; the next px.spawn of
    the same user removes it (its lock is free), and its own at its end."""
    tmp, where, script, env = _scene(tmp_path, "spawner.py", SPAWNER)

    def dirs() -> set[str]:
        return {p.name for p in tmp.iterdir() if p.name.startswith("phalanx-workers-")}

    parent = subprocess.Popen([sys.executable, str(script), str(where)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        _wait_for((where / "rank0.started").exists, "the spawned worker")
        (left,) = dirs()
        os.killpg(parent.pid, signal.SIGKILL)  # the spawner and its worker, no cleanup
        parent.communicate(timeout=TIMEOUT)
        assert left in dirs()
        result = subprocess.run([sys.executable, "-c", "import phalanx as px; "
                                 "print(px.spawn(lambda: 7, processes=1))"], env=env,
                                capture_output=True, text=True, timeout=TIMEOUT, check=False)
        assert result.returncode == 0 and "7" in result.stdout, result.stderr
        assert dirs() == set()  # the killed one's removed, and the new one's own at its end
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.communicate()
