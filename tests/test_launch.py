"""`phalanx run`: real jobs started as a user would, through `python -m phalanx run`.

Each job is a subprocess with a timeout, so a launcher that hangs fails its test instead of the
suite. The scripts under tests/launch_scripts/ print what each rank sees; the tests compare that
with what the world should be (ranks 0..N-1 once each, the all-reduced sum of the ranks
computed here). A failed job must end with one message naming the failed rank, and leave no
process running its script.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from phalanx import cli, launch

SCRIPTS = Path(__file__).parent / "launch_scripts"
TIMEOUT = 90  # seconds for one job; a healthy one takes a few


def phalanx(*args, cwd=None, timeout=TIMEOUT):
    return subprocess.run([sys.executable, "-m", "phalanx", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def world_lines(stdout: str) -> dict[int, dict]:
    """The WORLD lines of world.py, by rank, each checked to carry its own rank prefix."""
    seen = {}
    for prefix, fields in re.findall(r"^(\[rank\d+\]: )?WORLD (.*)$", stdout, re.M):
        values = dict(field.split("=") for field in fields.split())
        rank = int(values["rank"])
        assert rank not in seen, f"rank {rank} printed twice:\n{stdout}"
        if prefix:
            assert prefix == f"[rank{rank}]: ", stdout
        seen[rank] = {"prefixed": bool(prefix), **values}
    return seen


def assert_one_world(stdout: str, world_size: int):
    seen = world_lines(stdout)
    assert sorted(seen) == list(range(world_size)), stdout
    expected_sum = sum(range(world_size))  # the all-reduce, done here by hand
    for rank, values in seen.items():
        assert values["prefixed"], f"rank {rank}'s line lacks its prefix:\n{stdout}"
        assert int(values["world"]) == world_size
        assert int(values["sum"]) == expected_sum


def processes_running(token: str) -> list[str]:
    """Command lines of live processes (other than zombies) that mention `token`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token in cmdline and state != "Z":
            found.append(f"{pid}: {cmdline}")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("n,form", [(2, "module"), (3, "script")])
def test_n_workers_form_one_world(n, form):
    target = ["-m", "world"] if form == "module" else [SCRIPTS / "world.py"]
    result = phalanx("run", "-n", n, *target, "--lr", "0.1", cwd=SCRIPTS)
    assert result.returncode == 0, result.stderr
    assert_one_world(result.stdout, n)
    assert result.stdout.count("ARGS --lr 0.1") == n  # the script's own flags reach it
    assert "threads=1" in result.stdout  # OMP_NUM_THREADS=1 for several workers a node
    assert result.stderr == ""  # quiet: no agent chatter


def test_the_same_script_runs_under_plain_python():
    result = subprocess.run([sys.executable, SCRIPTS / "world.py"], capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert world_lines(result.stdout) == {0: {"prefixed": False, "rank": "0", "world": "1",
                                              "local": "0", "sum": "0", "threads": "None"}}


@pytest.mark.parametrize("survivors", ["sleep", "barrier"])
def test_a_failing_rank_ends_the_job_with_one_message(survivors):
    token = f"token-{uuid.uuid4().hex}"  # marks this job's processes
    args = [token] + (["--barrier"] if survivors == "barrier" else [])
    start = time.monotonic()
    result = phalanx("run", "-n", 3, SCRIPTS / "fail_on_rank_one.py", *args)
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - start < 60  # the sleeping ranks were stopped, not waited for
    messages = [line for line in result.stderr.splitlines() if line.startswith("phalanx run:")]
    assert messages == ["phalanx run: error: rank 1 exited with code 1: "
                        "ValueError: rank one is broken on purpose"], result.stderr
    report = result.stderr[result.stderr.index(messages[0]):]
    assert 'raise ValueError("rank one is broken on purpose")' in report  # its traceback
    assert "phalanx/launch.py" not in report  # without the launcher's own frames
    assert "[rank1]: ValueError: rank one is broken on purpose" in result.stderr
    assert processes_running(token) == []


def test_restarts_pass_through_to_the_agent():
    result = phalanx("run", "-n", 2, "--max-restarts", 1, SCRIPTS / "restart_once.py")
    assert result.returncode == 0, result.stderr
    assert sorted(re.findall(r"ATTEMPT rank=(\d) restart=(\d)", result.stdout)) == \
        [("0", "1"), ("1", "1")]


def test_two_nodes_on_one_machine_form_one_world():
    port = free_port()
    common = ["run", "--nnodes", 2, "-n", 2, "--master-addr", "127.0.0.1", "--master-port",
              port, SCRIPTS / "world.py"]
    nodes = [subprocess.Popen([sys.executable, "-m", "phalanx", *map(str, common[:1]),
                               "--node-rank", str(r), *map(str, common[1:])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (1, 0)]  # the worker node first: it waits for the master
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=TIMEOUT))
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    (out1, err1), (out0, err0) = outputs
    assert [node.returncode for node in nodes] == [0, 0], err0 + err1
    assert_one_world(out0 + out1, 4)
    assert sorted(world_lines(out0)) == [0, 1] and sorted(world_lines(out1)) == [2, 3]


@pytest.mark.parametrize("args,message", [
    (["-n", 0, SCRIPTS / "world.py"], "-n must be at least 1"),
    (["-n", 2, SCRIPTS / "no_such_script.py"], "no such script"),
    (["-n", 2, "-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
    (["-n", 1, "--nnodes", 2, "--node-rank", 2, SCRIPTS / "world.py"], "--node-rank"),
    (["-n", 1, "--max-restarts", -1, SCRIPTS / "world.py"], "--max-restarts"),
])
def test_bad_commands_give_one_line(args, message, capsys):
    assert cli.main(["run", *map(str, args)]) == 2  # in-process: no job starts, no need
    out, err = capsys.readouterr()                   # to pay for a fresh interpreter
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("phalanx run: error: ")
    assert message in err


def test_a_bad_command_is_one_line_from_the_real_command_too():
    result = phalanx("run", "-n", 2, SCRIPTS / "no_such_script.py")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"phalanx run: error: no such script: {SCRIPTS / 'no_such_script.py'}\n"


def test_an_absent_master_gives_one_line_after_the_join_timeout():
    port = free_port()  # nobody listens there
    start = time.monotonic()
    result = phalanx("run", "--nnodes", 2, "--node-rank", 1, "-n", 1, "--master-port", port,
                     "--join-timeout", 1, SCRIPTS / "world.py")
    assert result.returncode == 2
    assert result.stderr == (f"phalanx run: error: no master at 127.0.0.1:{port} after 1 s; "
                             "start node 0 with the same --master-addr and --master-port, or "
                             "raise --join-timeout\n")
    assert time.monotonic() - start < 30


def test_help_describes_every_flag(capsys):
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    flags = [s for action in parser._actions for s in action.option_strings]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--help"])
    assert exit_info.value.code == 0
    run_help = capsys.readouterr().out
    for flag in flags:
        assert flag in run_help
    assert "phalanx run -n 4 train.py" in run_help  # the module docstring, as description
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top_help = capsys.readouterr().out
    assert "run" in top_help and "elastic agent" in top_help
