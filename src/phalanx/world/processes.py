"""How many workers to start (`processes=`, `-n auto`), how many a machine holds, and a script
started again as them.

A leaf of the package (torch and the standard library only), so that `px.init`
(runtime.py), `px.spawn` (spawn.py) and `phalanx run` (cli.py) all read it without a circle.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["auto_processes", "process_count", "relaunch", "worker_limit", "check_worker_limit"]

# [Note: how many workers a machine holds]
# `phalanx run -n N`, `px.spawn(processes=N)` and `px.init(processes=N)` refuse an N past what
# the machine can hold, rather than start workers until it stops answering: at most
# WORKERS_PER_CORE workers a CPU core (several workers a core still run, for tests, and on a
# GPU node the cores outnumber the GPUs), and no more than the available memory holds at
# WORKER_MEMORY each. `phalanx run --oversubscribe` starts them anyway.
WORKERS_PER_CORE = 4
# Resident memory of one worker after px.init and a px.prepare of a small model, before the
# script's own data (gloo on CPU, torch 2.13, Linux: 236 MiB, 148 MiB of it its own and the
# rest shared libraries).
WORKER_MEMORY = 240 * 2**20


def auto_processes() -> int:
    """How many workers `processes="auto"` (and `phalanx run -n auto`) starts: one per GPU;
    on a machine without one, one per two CPU cores. On CPU each worker's compute already
    uses its cores and gloo's collectives run on CPU threads beside it, so more workers than
    half the cores only adds communication (2 ranks on this 2-core machine already fill it)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, (os.cpu_count() or 1) // 2)


def process_count(processes) -> int:
    """The number of workers `processes` asks for: an int, or "auto" / None (auto_processes)."""
    if processes is None or processes == "auto":
        return auto_processes()
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes={processes!r}: give a number of worker processes, 1 or "
                         "more, or 'auto' (one per GPU, or one per two CPU cores)")
    return processes


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _available_memory() -> int | None:
    """Bytes of memory available to start processes (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def worker_limit() -> tuple[int, str]:
    """The most workers this machine holds, and the reason, for the message that refuses
    more (see [Note: how many workers a machine holds])."""
    cores = _cores()
    limit = WORKERS_PER_CORE * cores
    why = f"{cores} CPU core{'s' if cores != 1 else ''}, at most {WORKERS_PER_CORE} workers a core"
    available = _available_memory()
    if available is not None and available // WORKER_MEMORY < limit:
        limit = max(1, available // WORKER_MEMORY)
        why = (f"{available / 2**30:.1f} GiB of memory available, about "
               f"{WORKER_MEMORY // 2**20} MiB a worker before its script's own")
    return limit, why


def check_worker_limit(n: int, asked: str, override: str) -> None:
    """Raise ValueError when `n` workers (`asked`: how they were asked for) are more than
    this machine holds; `override` says how to start them anyway."""
    limit, why = worker_limit()
    if n > limit:
        raise ValueError(f"{asked} asks for {n} workers, and this machine holds at most "
                         f"{limit} ({why}); ask for fewer, or {override}")


def relaunch(processes) -> None:
    """Replace this process by `phalanx run -n N` of the same script (returns for N = 1)."""
    if isinstance(processes, str) and processes.isdigit():  # from PHALANX_PROCESSES
        processes = int(processes)
    n = process_count(processes)
    if n == 1:
        return
    check_worker_limit(n, f"px.init(processes={processes!r})",
                       "start the script with phalanx run --oversubscribe -n N")
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        target = ["-m", spec.name.removesuffix(".__main__")]
    elif sys.argv and sys.argv[0] not in ("", "-c") and os.path.exists(sys.argv[0]):
        target = [os.path.abspath(sys.argv[0])]
    else:
        raise ValueError(
            f"px.init(processes={processes!r}) starts this script again as {n} workers, but "
            "this Python runs no script (a notebook, a REPL or python -c); there, use "
            "px.spawn(fn, processes=N)")
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, "-m", "phalanx", "run", "-n", str(n), *target, *sys.argv[1:]]
    os.execv(sys.executable, argv)
