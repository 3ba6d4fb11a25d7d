"""`phalanx run` checks its flags and the workers' PHALANX_* variables before it starts anything:
each mistake is one line naming it and the fix, exit status 2, and no worker started.

Every command runs as a user types it (`python -m phalanx run ...` in a subprocess, started
all at once, each with a timeout); the script would leave a file behind if a worker ran it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

import phalanx as px
from phalanx import cli
from phalanx.launch import cli as launch
from phalanx.spec.command_error import CommandError
from phalanx.world import processes
from phalanx.world.processes import WORKERS_PER_CORE, worker_limit


def _mistakes(tmp_path) -> dict[str, tuple[list, dict, str]]:
    """name -> (arguments, variables, words the one line must hold)."""
    (tmp_path / "a_file").write_text("")
    under_a_file = str(tmp_path / "a_file" / "below")
    limit, _ = worker_limit()
    return {
        "too many workers": (["-n", "100000"], {},
                             (f"-n 100000 asks for 100000 workers, and this machine holds at "
                              f"most {limit} (")),
        "log dir": (["-n", "1", "--log-dir", under_a_file], {},
                    (f"--log-dir {under_a_file}: {tmp_path / 'a_file'} is a file, not a "
                     "directory; name a directory this user can write to")),
        "master": (["-n", "1", "--master-addr", "no-such-host.invalid"], {},
                   "--master-addr no-such-host.invalid: no such host"),
        "backend": (["-n", "1"], {"PHALANX_BACKEND": "foo"},
                    "PHALANX_BACKEND='foo': not a torch.distributed backend; one of gloo"),
        "log every abc": (["-n", "1"], {"PHALANX_LOG_EVERY": "abc"},
                          "PHALANX_LOG_EVERY='abc': a whole number of steps, 1 or more"),
        "log every 0": (["-n", "1"], {"PHALANX_LOG_EVERY": "0"}, "PHALANX_LOG_EVERY='0': "),
        "log every -1": (["-n", "1"], {"PHALANX_LOG_EVERY": "-1"}, "PHALANX_LOG_EVERY='-1': "),
        "trace": (["-n", "1"], {"PHALANX_TRACE": under_a_file},
                  f"PHALANX_TRACE={under_a_file!r}: {tmp_path / 'a_file'} is a file"),
        "run dir": (["-n", "1"], {"PHALANX_RUN_DIR": "/proc/phalanx-test/run"},
                    "PHALANX_RUN_DIR='/proc/phalanx-test/run': cannot write in /proc"),
        "hang after": (["-n", "1"], {"PHALANX_HANG_AFTER": "0"},
                       "PHALANX_HANG_AFTER='0': a positive number of seconds"),
        # the two that phalanx run sets for its workers are checked too, then replaced
        "on failure": (["-n", "1"], {"PHALANX_ON_FAILURE": "sometimes"},
                       "PHALANX_ON_FAILURE='sometimes': one of 'continue', 'restart', 'stop'"),
        "joining": (["-n", "1"], {"PHALANX_JOINING": "x"},
                    "PHALANX_JOINING='x': the replacement's number, 0 or more"),
    }


# Three through the real command by default (each a new interpreter importing torch), every
# one in the slow run; every one in-process below.
FEW = ["too many workers", "log every 0", "log dir", "on failure"]


@pytest.mark.parametrize("which", ["few", pytest.param("all", marks=pytest.mark.slow)])
def test_each_mistake_is_one_line_exit_status_2_and_no_worker(tmp_path, which):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'a').write('ran')\n")
    jobs = {}
    for name, (args, variables, words) in _mistakes(tmp_path).items():
        if which == "few" and name not in FEW:
            continue
        env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
        jobs[name] = (subprocess.Popen(
            [sys.executable, "-m", "phalanx", "run", *args, str(script)], cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, **variables}),
            words)
    try:
        for name, (job, words) in jobs.items():
            out, err = job.communicate(timeout=120)
            assert (job.returncode, out) == (2, ""), f"{name}: {err}"
            assert err.count("\n") == 1 and err.startswith("phalanx run: error: "), f"{name}: {err}"
            assert words in err, f"{name}: {err}"
    finally:
        for job, _ in jobs.values():
            job.kill()
            job.wait()
    assert not marker.exists()  # no worker ran the script
    assert not (tmp_path / "runs").exists()  # nor was a run directory made


@pytest.mark.one_process
def test_each_mistake_in_process(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a worker ran')\n")
    for name, (args, variables, words) in _mistakes(tmp_path).items():
        with monkeypatch.context() as m:
            for key in [k for k in os.environ if k.startswith("PHALANX_")]:
                m.delenv(key)
            for key, value in variables.items():
                m.setenv(key, value)
            assert cli.main(["run", *args, str(script)]) == 2, name
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and words in err, f"{name}: {err}"


def _parsed(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return parser.parse_args([*argv, __file__])


@pytest.mark.one_process
def test_oversubscribe_lets_more_workers_start(monkeypatch):
    monkeypatch.setattr(processes, "_cores", lambda: 2)
    monkeypatch.setattr(processes, "_available_memory", lambda: 64 * 2**30)
    assert worker_limit() == (2 * WORKERS_PER_CORE,
                              f"2 CPU cores, at most {WORKERS_PER_CORE} workers a core")
    too_many = str(2 * WORKERS_PER_CORE + 1)
    with pytest.raises(CommandError,
                       match=f"-n {too_many} asks for {too_many} workers.*--oversubscribe"):
        launch.check_arguments(_parsed("-n", too_many))
    launch.check_arguments(_parsed("-n", too_many, "--oversubscribe"))  # no error


@pytest.mark.one_process
def test_memory_bounds_the_workers_where_it_holds_fewer(monkeypatch):
    monkeypatch.setattr(processes, "_cores", lambda: 64)
    monkeypatch.setattr(processes, "_available_memory", lambda: 3 * processes.WORKER_MEMORY)
    limit, why = worker_limit()
    assert limit == 3 and why.startswith(f"{3 * processes.WORKER_MEMORY / 2**30:.1f} GiB of "
                                         "memory available, about 240 MiB a worker")


@pytest.mark.one_process
def test_spawn_and_init_refuse_more_workers_than_the_machine_holds():
    limit, _ = worker_limit()
    with pytest.raises(ValueError, match=f"px.spawn\\(processes={limit + 1}\\) asks for "
                                         f"{limit + 1} workers, and this machine holds at most "
                                         f"{limit}"):
        px.spawn(print, processes=limit + 1)
    with pytest.raises(ValueError, match=f"px.init\\(processes={limit + 1}\\) asks for"):
        processes.relaunch(limit + 1)
