"""Limits that follow the machine's load, for the few tests that bound a whole job or whose
claim is a duration.

A test waits for events, never for a wall clock; but a job that hangs must still end its test,
so some tests bound a whole job (a docs example, a launched script) by a limit, and a few
claims are durations ("a rank leaves at once, not after its timeout"). On a machine shared with
other work (two cores running a dozen other processes) the same job takes many times longer
than alone, and a fixed limit fails a job that was only slowed. So these limits are in seconds
of an idle machine:

- `load_factor()`: how many times over the cores are asked for now (the runnable tasks per
  core: the larger of the one-minute load average and the tasks runnable at this instant, which
  a load that has just begun shows before the average does), at least 1 and at most
  `MAX_FACTOR`;
- `scaled(s)`: `s` times that factor, read once: for a limit handed to something that takes
  seconds (a process's own timeout, `run_ranks(timeout=)`), so that what it bounds and the
  bound slow down together;
- `LoadClock`: a clock that advances by the wall time divided by the factor, read at every
  look: a job given 120 s has 120 s on an idle machine and about 9 times that at load 18 on 2
  cores, however the load changes while it runs; `run` bounds a command by it.

A hang still ends the test: the clock always advances, at worst `MAX_FACTOR` times slower than
the wall clock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

MAX_FACTOR = 16.0  # a limit is never stretched further: a hang still ends the test


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_factor() -> float:
    """The tasks runnable per core, from 1 (an idle machine, or one no busier than its cores)
    to MAX_FACTOR."""
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        # "0.52 0.58 0.59 3/456 1234": the averages, then the tasks runnable now (this reader
        # among them) of all tasks
        load = max(float(fields[0]), int(fields[3].split("/")[0]) - 1)
    except (OSError, IndexError, ValueError):
        try:
            load = os.getloadavg()[0]
        except OSError:  # no load average on this platform: take the machine as idle
            load = 0.0
    return min(max(1.0, load / _cores()), MAX_FACTOR)


def scaled(seconds: float) -> float:
    """`seconds` of an idle machine, in seconds of this machine at its present load."""
    return seconds * load_factor()


class LoadClock:
    """Seconds of an idle machine since it was made: the wall time, each stretch of it divided
    by the load factor read at its end (so read it often: at every poll)."""

    def __init__(self):
        self._last = time.monotonic()
        self._spent = 0.0

    def seconds(self) -> float:
        now = time.monotonic()
        self._spent += (now - self._last) / load_factor()
        self._last = now
        return self._spent


def run(args, limit: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True, **kwargs)` with a limit of `limit`
    seconds of an idle machine (`LoadClock`). The command runs in a session of its own; past the
    limit every process of that session is killed (a launcher's workers too, not only the
    command) and `subprocess.TimeoutExpired` is raised with what it printed."""
    clock = LoadClock()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=0.5)  # retried: no output is lost
                break
            except subprocess.TimeoutExpired:
                if clock.seconds() > limit:
                    _kill_session(proc)
                    out, err = proc.communicate()
                    raise subprocess.TimeoutExpired(args, limit, out, err) from None
    finally:
        if proc.poll() is None:  # an exception of the test's own (KeyboardInterrupt)
            _kill_session(proc)
            proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its session's group: start_new_session above
    except ProcessLookupError:
        pass
