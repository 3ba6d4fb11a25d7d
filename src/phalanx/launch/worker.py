"""The worker's entry point: `python -m phalanx.launch.worker [-m] TARGET ARGS...`, started by
the agent once per rank.

It runs the user's script or module as `__main__`, leaves an error file when it fails, and
then leaves the process without interpreter finalisation: see [Note: leaving without
finalisation]. It never outlives the launcher: see [Note: no worker outlives its launcher].
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import gc
import io
import json
import os
import re
import runpy
import signal
import sys
import threading
import time
import traceback

__all__ = ["run", "leave", "end_file", "end_with_the_launcher"]

_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent ends
# torch.distributed's excepthook's prefix: one per process group made (each wraps the last)
_TORCH_PREFIX = re.compile(r"^(\[rank\d+\]: )+")
# The file objects that hold written data in Python until flushed.
_BUFFERED_FILES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
_FAILED_EXIT_WAIT = 10.0  # seconds a failed worker's exit handlers may take (see `leave`)


def run(argv: list[str]) -> tuple[int, object]:
    """Run the user's script or module as `__main__`, leaving an error file if it fails.

    Returns the exit status and what must stay alive until the process ends: the script's
    globals (or the exception, whose frames hold them).

    The agent gives each worker an error file (TORCHELASTIC_ERROR_FILE) in the JSON layout of
    torch.distributed.elastic's `record`; it is written here rather than through `record` to
    add a sub-second time (which rank failed first), to record non-zero sys.exit() codes,
    and to leave this wrapper's frames out of the traceback.
    """
    faulthandler.enable(all_threads=True)  # a crash in C code still prints Python stacks
    is_module = argv[:1] == ["-m"]
    target, script_args = (argv[1], argv[2:]) if is_module else (argv[0], argv[1:])
    sys.argv = [target, *script_args]
    if not is_module and not getattr(sys.flags, "safe_path", False):
        # `python -m` put the cwd first on the path; `python script.py` puts the script's
        # directory there instead.
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    try:
        if is_module:
            kept = runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            kept = runpy.run_path(target, run_name="__main__")
        _record_end("the script ended")
        return 0, kept
    except SystemExit as exc:
        code = exc.code
        if code in (None, 0):
            _record_end(f"the script called sys.exit({'' if code is None else code})")
            return 0, exc
        headline = f"sys.exit({code!r})" if isinstance(code, int) else str(code)
        _record_failure(exc.with_traceback(_user_frames(exc.__traceback__)), headline)
        if isinstance(code, int):
            return code, exc
        print(code, file=sys.stderr)  # what Python does with sys.exit("message")
        return 1, exc
    except BaseException as exc:  # noqa: BLE001 - recorded for the launcher and printed
        exc = exc.with_traceback(_user_frames(exc.__traceback__))
        if isinstance(exc, Exception):
            _say_raised(exc)
        _record_failure(exc, f"{type(exc).__name__}: {exc}")
        _print_exception(exc)  # for Ctrl-C too: where each rank was is worth seeing
        return (128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1), exc


def _say_raised(exc: Exception) -> None:
    """Under `--on-failure continue`, tell the other workers that this one ends on an
    exception (they skip the step rather than redo it: phalanx/continuing/steps.py)."""
    continuation = sys.modules.get("phalanx.comm.continuation")  # None: phalanx never imported
    if continuation is not None:
        with contextlib.suppress(Exception):
            continuation.now().raised(exc)


def leave(code: int) -> None:
    """[Note: leaving without finalisation]

    End the worker as a normal exit would (wait for the script's non-daemon threads, run the
    `atexit` handlers, flush every stream), then `os._exit(code)` instead of letting the
    interpreter finalise. A `px.shutdown()` that the end of the script called and that raised
    (phalanx/leaving.py) makes a status of 0 into 1, with an error file: the job did not
    complete.

    Finalisation tears down modules and frees objects in no particular order while native
    threads still run. A gloo process group that is still alive at that point (the script
    did not call `px.shutdown()`, or something still holds the group) has worker threads that
    hold work objects with Python tensors; freeing those during finalisation aborts the
    process ("terminate called without an active exception", SIGABRT) in a few runs in a
    hundred of an ordinary script (pytorch/pytorch#179291). Nothing useful happens in
    finalisation once the handlers have run and the streams are flushed, so it is skipped.

    A failed worker's handlers get `_FAILED_EXIT_WAIT` seconds: its end says in the job's
    store that it failed (phalanx/leaving.py), and a store whose serving process is frozen
    (rank 0's worker serves it under restart and stop: launch/rendezvous.py) never answers,
    whatever the store's timeout, so that call would keep the worker, and the job, forever.
    """
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    leaving = sys.modules.get("phalanx.world.leaving")
    if leaving is not None:
        if code:  # a failed worker does not wait at its end for its peers (phalanx/leaving.py)
            leaving.failing()
        leaving.caller_sets_exit_status()
    if code:
        handlers = threading.Thread(target=atexit._run_exitfuncs, daemon=True)
        handlers.start()
        handlers.join(_FAILED_EXIT_WAIT)
        if handlers.is_alive():
            print(f"phalanx: a failed worker's exit handlers did not end within "
                  f"{_FAILED_EXIT_WAIT:.0f} s (the job's store does not answer?): it ends "
                  "without them", file=sys.stderr, flush=True)
    else:
        atexit._run_exitfuncs()
    error = leaving.shutdown_error() if leaving is not None else None
    if error is not None and not code:  # px.shutdown() at the end of the script raised
        _record_failure(error, f"px.shutdown() at the end of the script failed: "
                               f"{type(error).__name__}: {error}")
        code = 1
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):  # what C and C++ code wrote through stdio
        ctypes.CDLL(None).fflush(None)
    os._exit(code & 0xFF)  # as the OS truncates a normal exit status: sys.exit(-1) is 255


def _flush_open_files() -> None:
    """Flush every open Python file, as finalisation would when it frees them (a script may
    leave a log file open without closing it)."""
    # type(obj), not isinstance: isinstance reads `obj.__class__`, which some objects (torch's
    # deprecated `reduce_op`) answer with a warning.
    for obj in gc.get_objects():
        if issubclass(type(obj), _BUFFERED_FILES):
            with contextlib.suppress(Exception):
                if not obj.closed:
                    obj.flush()


def _user_frames(tb):
    """The traceback from the user's first frame on, without runpy's and this module's."""
    start = tb
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    return tb if tb is not None else start


def _print_exception(exc: BaseException) -> None:
    """Print `exc` through sys.excepthook, as Python does with an uncaught exception.

    torch.distributed's hook puts "[rankN]: " before every line; the launcher already does,
    so that prefix is taken off here rather than printed twice. Each group made wraps the hook
    again with its own rank (under `--on-failure continue`, one per generation, its N not
    always the launch rank): every such prefix goes.
    """
    buffer = io.StringIO()
    with contextlib.redirect_stderr(buffer):
        sys.excepthook(type(exc), exc, exc.__traceback__)
    lines = buffer.getvalue().split("\n")
    sys.stderr.write("\n".join(_TORCH_PREFIX.sub("", line, count=1) for line in lines))
    sys.stderr.flush()


def end_file(error_file: str) -> str:
    """[Note: a script's end, for the launcher]
    Where a worker notes that its script has ended well (it returned, or called sys.exit(0)):
    beside its error file, `ended.json`, with how and at which optimizer step. Its end is
    then no failure, but if the job fails after it, through a hang report or a lost peer, the
    ranks that had ended are those that left early, and the launcher's message names them
    (launch/failures.py); a rank that ends well goes on answering its peers until they end
    too (phalanx/leaving.py), so its process may well be stopped with theirs."""
    return os.path.join(os.path.dirname(error_file), "ended.json")


def _record_end(how: str) -> None:
    with contextlib.suppress(Exception):  # what its key says at its end (phalanx/leaving.py)
        sys.modules["phalanx.world.leaving"].ending(how)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    records = sys.modules.get("phalanx.comm.records")
    step = None
    with contextlib.suppress(Exception):
        step = records.current_step() if records is not None else None
    _write_whole(end_file(path), {"how": how, "step": step, "time": time.time()})


def _write_whole(path: str, data: dict) -> None:
    """Write `data` as JSON to `path` whole or not at all: the agent stops the other workers
    as soon as one fails, and a worker stopped halfway through writing left a truncated file
    that the agent's JSON reader then failed on (JSONDecodeError instead of the message)."""
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(data, f)
        os.replace(partial, path)
    except OSError:
        pass  # what it would say is on stderr too


def _record_failure(exc: BaseException, headline: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    _write_whole(path, {"message": {"message": headline, "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(exc)),
        "timestamp": str(int(now)),  # what the agent reads: whole seconds
        "time": now,
    }}})


def end_with_the_launcher() -> None:
    """[Note: no worker outlives its launcher]
    A launcher that is killed (SIGKILL, the out-of-memory killer, a test's timeout) cannot end
    its workers, and they would live on without it: training alone, waiting on a store that
    has gone, or, frozen (SIGSTOP), forever. So each worker asks the kernel to kill it when the
    launcher ends (Linux's parent-death signal), with SIGKILL, the one signal a frozen process
    receives. A launcher that ends normally has ended its workers first (torch's agent: SIGTERM,
    and SIGKILL 30 s later), so this only ever ends orphans. A launcher gone between the two
    looks at the parent's pid below ends the worker at once."""
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    end_with_the_launcher()
    status, keep_alive = run(sys.argv[1:])  # the script's objects live until the process ends
    leave(status)
