"""How many workers to start (`processes=`, `-n auto`), and a script started again as them.

A leaf of the package (torch and the standard library only), so that `px.init`
(runtime.py), `px.spawn` (spawn.py) and `phalanx run` (cli.py) all read it without a circle.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["auto_processes", "process_count", "relaunch"]


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


def relaunch(processes) -> None:
    """Replace this process by `phalanx run -n N` of the same script (returns for N = 1)."""
    if isinstance(processes, str) and processes.isdigit():  # from PHALANX_PROCESSES
        processes = int(processes)
    n = process_count(processes)
    if n == 1:
        return
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
