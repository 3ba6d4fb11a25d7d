"""The `PHALANX_*` environment variables: one table of their names, how each is read, and what
each means.

[Note: one table of variables]
Every variable phalanx reads is a row of `VARIABLES`: its name, who reads it, its meaning (the
row of docs/reference/environment.md, which tests/test_environment.py holds equal to
`markdown_rows()`), and a parser from the text to the value. The code that uses a variable
reads it through `value(name)`, never `os.environ` itself, so a variable means the same thing
wherever it is read. `check()` parses every variable that is set and raises one error that
names each bad one with the fix; `px.init` calls it first, on every rank, before joining
anything, and `phalanx run` before starting a worker (exit status 2), so a typo fails at once
rather than after training, when the variable is first used.

A leaf of the package (the standard library, and torch inside two parsers), so that modules
read at import time, such as comm/mismatch.py, can read it too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["VARIABLES", "Variable", "backend_name", "check", "device_name", "markdown_rows",
           "problems", "value", "why_not_writable_dir"]


@dataclass(frozen=True)
class Variable:
    name: str
    read_by: str          # the docs' "read by" column
    meaning: str          # the docs' "meaning" column (Markdown)
    parse: Callable[[str], object]  # the set, non-empty text -> its value; ValueError: the fix
    # `phalanx run` sets it for its workers, whatever it was; a value set before is checked all
    # the same (a typo is a typo), and its error says to leave it unset
    launcher_sets: bool = False


# -- parsers: each raises ValueError with what a good value looks like ------------------------
def _flag(text: str) -> bool:
    if text.strip() not in ("0", "1"):
        raise ValueError("1 turns it on, 0 (or leaving it unset) off")
    return text.strip() == "1"


def _whole(least: int, what: str, example: str):
    def parse(text: str) -> int:
        try:
            number = int(text.strip())
        except ValueError:
            number = None
        if number is None or number < least:
            raise ValueError(f"{what}, {least} or more; for example {example}")
        return number
    return parse


def _seconds_or_off(text: str) -> float | bool:
    """PHALANX_HANG_AFTER: a positive number of seconds, or "off" (False; unset is None)."""
    if text.strip().lower() == "off":
        return False
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError("a positive number of seconds such as 60, or 'off' for no hang "
                         "report; unset: a third of px.init(timeout=)")
    return seconds


def _processes(text: str) -> int | str:
    if text.strip() == "auto":
        return "auto"
    return _whole(1, "a number of worker processes", "2, or 'auto' (one per GPU, or one "
                  "per two CPU cores)")(text)


def _one_of(*choices: str):
    def parse(text: str) -> str:
        if text.strip() not in choices:
            raise ValueError("one of " + ", ".join(repr(c) for c in choices))
        return text.strip()
    return parse


def backend_name(text: str) -> str:
    """A torch.distributed backend this torch has: "gloo", "nccl", "mpi", ..., or the
    per-device form "cpu:gloo,cuda:nccl" (lower case, as torch spells them)."""
    import torch.distributed as dist

    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    names = [part.split(":")[-1].strip().lower() for part in text.split(",")]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"not a torch.distributed backend; one of {', '.join(known)} "
                         "(gloo on CPU, nccl on NVIDIA GPUs), or unset to pick one")
    if "nccl" in names:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("NCCL needs CUDA GPUs, and this process sees none "
                             "(torch.cuda.is_available() is False); use gloo, the CPU backend "
                             "(backend='gloo', PHALANX_BACKEND=gloo), or leave the backend "
                             "unset to pick the one that fits")
    missing = [n for n in names
               if not getattr(dist, f"is_{n}_available", lambda: True)()]
    if missing:
        raise ValueError(f"this torch is built without {', '.join(missing)}; use gloo (CPU) "
                         "or nccl (NVIDIA GPUs), or unset it to pick one")
    return text.strip().lower()


def device_name(text: str) -> str:
    import torch

    try:
        return str(torch.device(text.strip()))
    except (RuntimeError, TypeError, ValueError):
        raise ValueError("a device such as 'cpu', 'cuda' or 'cuda:1'") from None


def why_not_writable_dir(path: str) -> str | None:
    """Why `path` cannot be a directory this process writes to (None: it can): it is a file,
    or the nearest part of it that exists is not a directory this process can write in.

    The directory itself is not made (a run that never writes there leaves no trace); the
    nearest existing part is tried by making and removing an empty file in it, since
    `os.access` answers yes to root everywhere, read-only file systems included."""
    path = os.path.abspath(os.path.expanduser(path))
    here = path
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        return f"{here} is a file, not a directory"
    made = "" if here == path else f" (to make {path} in it)"
    if not os.access(here, os.W_OK | os.X_OK):
        return f"cannot write in {here}{made}: permission denied"
    try:
        fd, probe = tempfile.mkstemp(prefix=".phalanx-write-check-", dir=here)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        return f"cannot write in {here}{made}: {exc.strerror or exc}"
    return None


def _directory(text: str) -> str:
    why = why_not_writable_dir(text)
    if why is not None:
        raise ValueError(f"{why}; name a directory this user can write to")
    return text


def _trace(text: str) -> str | bool:
    """PHALANX_TRACE: False (off), True (into the run directory) or a directory of its own."""
    if text.strip() in ("0", "1"):
        return text.strip() == "1"
    return _directory(text)


def _terminal(text: str) -> str:
    if not os.path.exists(text):
        raise ValueError("no such terminal; phalanx run sets it to its own, unset it")
    return text


_HANGS = "[A job that hangs](../guides/failures.md#a-job-that-hangs)"
_CONTINUE = "[Training on through a failure](../guides/failures.md#training-on-through-a-failure)"

VARIABLES: dict[str, Variable] = {v.name: v for v in [
    Variable("PHALANX_BACKEND", "`px.init`",
             "the process group's backend when `px.init(backend=None)`: `gloo` or `nccl` (or "
             "another torch.distributed backend this torch has). Default: NCCL when CUDA is "
             "available and gloo otherwise. `px.spawn`'s and `phalanx run`'s workers read it too.",
             backend_name),
    Variable("PHALANX_DEVICE", "`px.init`",
             "this rank's device when `px.init(device=None)`: `cuda` (this rank's GPU, "
             "`cuda:LOCAL_RANK`, shared round-robin when gloo ranks outnumber the GPUs), "
             "`cuda:N` or `cpu`. Default: this rank's GPU under NCCL, the CPU under gloo. "
             "`PHALANX_BACKEND=gloo PHALANX_DEVICE=cuda` lets several ranks share one GPU (for "
             "tests, not for speed).", device_name),
    Variable("PHALANX_PROCESSES", "`px.init`",
             "in a script started with plain `python`: `N` or `auto` makes the process "
             "`phalanx run -n N` of the same script and arguments, as `px.init(processes=N)` "
             "does; ignored under a launcher.", _processes),
    Variable("PHALANX_HANG_AFTER", "`px.init`",
             "seconds a collective may wait before the hang report ends the job (default: a "
             "third of `px.init(timeout=)`, 200 s for the default 600 s); `off` turns the hang "
             f"report off. `px.init(hang_after=)` takes precedence. See {_HANGS}.",
             _seconds_or_off),
    Variable("PHALANX_CHECK_COLLECTIVES", "import of phalanx",
             "`1`: before each collective the ranks compare what they are about to issue and "
             "raise `CollectiveMismatch` on every rank when they differ. A debugging mode: every "
             "collective waits for every rank. Read once, when phalanx is imported.", _flag),
    Variable("PHALANX_RUN_DIR", "`px.log`, `phalanx report`, `PHALANX_TRACE`",
             "the run directory rank 0 writes `metrics.csv`, `run.json` and traces to: a "
             "directory this user can write to (made at the first write). Default "
             "`runs/phalanx-DATE-TIME` under the working directory; `phalanx run` sets one for "
             "all its workers.", _directory),
    Variable("PHALANX_LOG_EVERY", "`px.log`",
             "print one line every N steps, N 1 or more (default 10); `px.log(every=)` takes "
             "precedence.", _whole(1, "a whole number of steps", "PHALANX_LOG_EVERY=10")),
    Variable("PHALANX_TRACE", "the step clock",
             "`1`: each rank writes `RUN_DIR/trace_rank<R>.json` (a Perfetto timeline) at "
             "`px.shutdown()` or exit; a directory: write the traces there instead; `0`: no "
             "traces. See [Monitoring](../guides/monitoring.md#a-timeline-phalanx_trace).",
             _trace),
    Variable("PHALANX_TTY", "`px.progress`",
             "the terminal to draw the progress bar on; `phalanx run` sets it to the terminal it "
             "was started from, so the bar appears there and not in the workers' captured "
             "output.", _terminal),
    Variable("PHALANX_ON_FAILURE", "`px.init`",
             f"`continue`: this worker trains through a failure of another (see {_CONTINUE}); "
             "`restart` or `stop`: a failure ends the job (or restarts it). `phalanx run "
             "--on-failure` sets it for its workers.", _one_of("continue", "restart", "stop"),
             launcher_sets=True),
    Variable("PHALANX_JOINING", "`px.init`",
             "set by `phalanx run --on-failure continue` in a replacement's environment: its "
             "number (1 for the first replacement of a rank); such a worker waits to be admitted "
             "at the others' next `px.save` instead of joining the launch.",
             _whole(0, "the replacement's number", "1"),
             launcher_sets=True),
    Variable("PHALANX_DEBUG_ELASTIC", "`--on-failure continue`",
             "`1`: every worker prints one line on stderr per transition (a loss seen, a "
             "decision, a group formed, the launch order agreed), for a report.", _flag),
]}


def _raw(name: str, environ) -> str | None:
    text = (os.environ if environ is None else environ).get(name)
    return None if text is None or not text.strip() else text


def value(name: str, environ=None):
    """The value of variable `name` (None when unset or empty), or a ValueError naming it,
    the text it has, and what it takes."""
    text = _raw(name, environ)
    if text is None:
        return None
    try:
        return VARIABLES[name].parse(text)
    except ValueError as exc:
        raise ValueError(f"{name}={text!r}: {exc}") from None


def problems(environ=None, skip=()) -> list[str]:
    """One line per variable set to a value it does not take (those in `skip` aside)."""
    found = []
    for name in VARIABLES:
        if name in skip:
            continue
        try:
            parsed = value(name, environ)
        except ValueError as exc:
            found.append(str(exc) + ("; phalanx run sets it for its workers: leave it unset"
                                     if VARIABLES[name].launcher_sets else ""))
            continue
        if name == "PHALANX_TRACE" and parsed is True and _raw("PHALANX_RUN_DIR",
                                                                environ) is None:
            why = why_not_writable_dir("runs")  # the default run directory (metrics.py)
            if why is not None:
                found.append(f"PHALANX_TRACE=1 writes to the run directory, runs/ under the "
                             f"working directory, and {why}; set PHALANX_RUN_DIR or "
                             "PHALANX_TRACE to a directory this user can write to")
    return found


def check(environ=None, skip=()) -> None:
    """Raise one ValueError naming every PHALANX_* variable set to a value it does not take."""
    found = problems(environ, skip)
    if len(found) == 1:
        raise ValueError(found[0])
    if found:
        raise ValueError(f"{len(found)} PHALANX_* variables are set to values they do not "
                         "take:" + "".join(f"\n  {line}" for line in found))


def markdown_rows() -> list[str]:
    """The rows of the table in docs/reference/environment.md, one per variable."""
    return [f"| `{v.name}` | {v.read_by} | {v.meaning} |" for v in VARIABLES.values()]
