"""px.spawn: real worker processes from inside this one, rank 0's value back, failures raised
here with the rank named, and no worker left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import phalanx as px
from phalanx.launch.spawn import SpawnError, SpawnTimeout
from phalanx.world.runtime import auto_processes


def _children() -> list[int]:
    """Live (not zombie) child processes of this process, from the process table."""
    me, found = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            found.append(int(pid))
    return found


def _world(scale):
    t = torch.tensor([float(px.rank())])
    if px.world_size() > 1:
        dist.all_reduce(t)
    return {"rank": px.rank(), "world": px.world_size(), "sum": t.item() * scale}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_spawn_returns_rank_zeros_value(n):
    result = px.spawn(_world, 10, processes=n, timeout=120)
    assert result == {"rank": 0, "world": n, "sum": 10 * sum(range(n))}
    assert _children() == []


def _fail_on_rank_one():
    if px.rank() == 1:
        raise ValueError("rank one is broken on purpose")
    time.sleep(60)  # the others would wait long: they must be ended, not waited for


def _fail_on_rank_one_while_rank_zero_waits():
    if px.rank() == 1:
        raise ValueError("rank one is broken on purpose")
    dist.barrier()  # rank 0 then fails too: its peer went away


def test_the_failing_rank_comes_before_the_ranks_that_lost_it():
    """The cause first: rank 0's "connection closed" is the consequence of rank 1's error."""
    for _ in range(3):
        with pytest.raises(SpawnError) as caught:
            px.spawn(_fail_on_rank_one_while_rank_zero_waits, processes=2, timeout=120)
        message = str(caught.value)
        assert message.index("--- rank 1 failed") < message.index("rank one is broken"), message
        assert "--- rank 0" not in message or \
            message.index("--- rank 1 failed") < message.index("--- rank 0"), message


def test_an_exception_on_a_rank_is_raised_here_naming_it():
    start = time.monotonic()
    with pytest.raises(SpawnError) as caught:
        px.spawn(_fail_on_rank_one, processes=3, timeout=120)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert caught.value.ranks == [1]
    assert "--- rank 1 failed:\nValueError: rank one is broken on purpose" in message
    assert 'raise ValueError("rank one is broken on purpose")' in message  # its traceback
    assert _children() == []


def _stuck():
    if px.rank() == 0:
        time.sleep(120)


def test_a_stuck_worker_is_ended_at_the_timeout_with_its_stack():
    start = time.monotonic()
    with pytest.raises(SpawnTimeout) as caught:
        px.spawn(_stuck, processes=2, timeout=3)
    assert time.monotonic() - start < 20
    assert caught.value.ranks == [0]
    assert "in _stuck" in str(caught.value)  # where it was stuck
    assert _children() == []


def test_a_function_defined_in_a_scripts_main_works(tmp_path):
    script = tmp_path / "notebook_like.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        import phalanx as px

        def train(n):  # defined in __main__, as in a notebook cell
            t = torch.ones(1)
            dist.all_reduce(t)
            return f"rank {px.rank()} of {px.world_size()} saw {int(t.item())} and {n}"

        print(px.spawn(train, 7, processes=2, timeout=120))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "rank 0 of 2 saw 2 and 7"


@pytest.mark.one_process
def test_auto_is_one_per_gpu_or_one_per_two_cores():
    expected = torch.cuda.device_count() if torch.cuda.is_available() \
        else max(1, (os.cpu_count() or 1) // 2)
    assert auto_processes() == expected


@pytest.mark.one_process
@pytest.mark.parametrize("bad", [0, -1, 1.5, "four", True])
def test_a_bad_process_count_is_refused(bad):
    with pytest.raises(ValueError, match="number of worker processes"):
        px.spawn(_world, 1, processes=bad)


def _ctrl_c_heard():
    """In the child before it runs Python: Ctrl-C back to its default, which Python turns into
    KeyboardInterrupt. A suite started in the background by a shell without job control (`pytest
    &` in a script) inherits SIGINT ignored, and the scripts below would never hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_every_worker(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent("""
        import time
        import phalanx as px

        def wait():
            time.sleep(120)

        px.spawn(wait, processes=2, timeout=300)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_heard)

    def running() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(script) in cmdline and state != "Z":
                found.append(int(pid))
        return found

    try:
        deadline = time.monotonic() + 60
        while len(running()) < 3 and time.monotonic() < deadline:  # the caller and 2 workers
            time.sleep(0.2)
        assert len(running()) == 3, "the workers did not start"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err
    time.sleep(0.5)
    assert running() == []


def test_ctrl_c_while_a_worker_is_being_started_still_ends_it(tmp_path):
    # The Ctrl-C lands inside the second worker's start, after its fork and before px.spawn has
    # recorded it: that worker must be ended too, or the interpreter's exit waits on it (before
    # the Ctrl-C was held during a start, this script hung until the test's 60 s ran out).
    script = tmp_path / "interrupted_in_start.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing.process
        import os
        import signal
        import time
        import phalanx as px

        start = multiprocessing.process.BaseProcess.start
        started = []

        def start_then_interrupted(self):
            start(self)
            started.append(self.pid)
            if len(started) == 2:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)  # the signal's handler runs here, inside start

        multiprocessing.process.BaseProcess.start = start_then_interrupted

        def wait():
            time.sleep(120)

        try:
            px.spawn(wait, processes=2, timeout=300)
        finally:
            print("workers", *started, flush=True)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_ctrl_c_heard)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the worker it left behind
        pytest.fail("the script did not end within 60 s of the Ctrl-C: a worker was left running")
    assert "KeyboardInterrupt" in err, err
    workers = [int(pid) for pid in out.split()[1:]]
    assert len(workers) == 2, out
    time.sleep(0.5)
    assert [pid for pid in workers if Path(f"/proc/{pid}").exists()] == []
