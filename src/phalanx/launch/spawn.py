"""`px.spawn`: run a function on N worker processes of this machine, from a notebook or a script.

    import phalanx as px

    def train(lr):
        model, optimizer = px.prepare(make_model(), ..., strategy="ddp")
        ...
        return px.unwrap(model).state_dict()      # rank 0's return value comes back

    state = px.spawn(train, 3e-4, processes=4)    # or processes="auto"

Each worker is a real process with `px.init()` already done (one per GPU where there are GPUs,
NCCL; gloo on CPU), so the function uses the ordinary loop; there is no thread, no scatter
through one device, no master copy on device 0. An exception on any rank is raised here as a
`SpawnError` naming the rank, with its traceback; the other workers are then ended, and so
are all of them on Ctrl-C or at `timeout`, whose error holds the Python stack of each worker
still running. No worker outlives the call.

[Note: fork or spawn]
Workers are forked on a machine without a GPU: they start in milliseconds and a function
defined in a notebook cell or in `__main__` needs no pickling, because the child is a copy of
this process. On a machine with a GPU they are started fresh ("spawn") instead, always: a
process that has initialised the CUDA driver cannot be forked into workers that use the GPU,
and `torch.cuda.is_available()`, which most notebooks call first, initialises it (unless
PYTORCH_NVML_BASED_CUDA_CHECK=1), with no way to ask afterwards whether it did. (The GPUs are
counted through NVML, `torch.cuda.device_count()`, which initialises nothing.) A fresh worker
receives the function and its arguments by value through cloudpickle, so a function defined in
a notebook cell works there too; it imports torch again, which takes seconds.
`testing.run_ranks`, the harness of every multi-process test, is this same mechanism.

[Note: leaving together]
A worker that has delivered its result waits for the parent's word before it leaves, and the
parent gives it once every rank's result is in. A rank that left as soon as it was done would
close its connections while a slower peer may still be inside `init_process_group` or a last
collective with it, and that peer would fail with gloo's "Connection closed by peer" (seen
here: one rank of a two-rank harness run returned at once and the other, still connecting,
failed). A rank that failed leaves at once; its peers' errors about the lost connection are
listed after its own.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback

from ..world.processes import check_worker_limit
from ..world.runtime import process_count
from . import scratch

__all__ = ["spawn", "SpawnError", "SpawnTimeout", "run_workers"]

# After the first failure the others get this long to fail too (they are usually blocked in a
# collective with the dead rank) before they are ended.
GRACE_S = 3.0


class SpawnError(RuntimeError):
    """Workers failed; the message holds each failed rank's traceback (`ranks` lists them)."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = ranks or []


class SpawnTimeout(SpawnError):
    """Workers did not finish in time; the message holds the stacks of those still running."""


def spawn(fn, *args, processes=None, timeout: float | None = None, **kwargs):
    """Run `fn(*args, **kwargs)` on `processes` workers of this machine (an int, or "auto",
    the default: one per GPU, or one per two CPU cores) and return rank 0's return value.

    Each worker is a process with `px.init()` already done (NCCL, one GPU each, where there
    are GPUs; gloo on CPU), so `fn` is an ordinary training function. Without a GPU the
    workers are forked: they start in milliseconds, and a function defined in a notebook cell
    or in `__main__` works as it is. With a GPU they start fresh and receive `fn` and its
    arguments by value (cloudpickle, so a notebook's function works there too), importing
    torch again, which takes seconds.

    More workers than the machine holds (4 a CPU core, and what the available memory holds
    at about 240 MiB a worker) are refused with a ValueError that says how many it holds.

    An exception on any rank is raised here as `px.SpawnError` naming the rank, with its
    traceback, and the other workers are ended; so are all of them on Ctrl-C, and at
    `timeout` seconds (default: none), whose error holds the Python stack of each worker
    still running. No worker outlives the call.
    """
    # How: [Note: fork or spawn] and [Note: leaving together] above.
    if not callable(fn):
        raise TypeError(f"px.spawn(fn, *args, processes=N, **kwargs) runs the function fn on "
                        f"every worker; its first argument is {type(fn).__name__} {fn!r:.60}, "
                        "not a function (processes= is a keyword: px.spawn(train, processes=2))")
    n = process_count(processes)
    check_worker_limit(n, f"px.spawn(processes={processes!r})",
                       "use phalanx run --oversubscribe -n N for a script")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout={timeout!r}: a positive number of seconds, or None")
    return run_workers(fn, n, args, kwargs, timeout=timeout, collect="rank0",
                       shutdown=True)[0]


def _start_method() -> str:
    """See [Note: fork or spawn]."""
    import torch

    if "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized() \
            and torch.cuda.device_count() == 0:
        return "fork"
    return "spawn"


def _by_value(fn, args, kwargs) -> bytes:
    """The call, pickled by value for a fresh worker (see [Note: fork or spawn])."""
    import cloudpickle

    return cloudpickle.dumps((fn, args, kwargs))


def _fresh_worker_main(call: bytes, *rest):
    import cloudpickle

    fn, args, kwargs = cloudpickle.loads(call)
    _worker_main(fn, args, kwargs, *rest)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The handler `_ctrl_c_held` replaced, while it holds; a worker forked meanwhile reads it first
# to put it back. Not a job's state (see [Note: process-wide state] in world/process.py).
_ctrl_c_handler = None


@contextlib.contextmanager
def _ctrl_c_held():
    """Hold a Ctrl-C that lands inside the block until its end. A worker is recorded for the
    cleanup only once `start` returns; a Ctrl-C raised inside `start`, after the fork, would
    leave that worker unrecorded and running, and the interpreter's exit would then wait on it.
    Python runs signal handlers in the main thread only, so elsewhere there is nothing to hold;
    a handler installed from C (`getsignal` gives None) is left alone, as it could not be put
    back."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is None:
        yield
        return
    global _ctrl_c_handler
    caught = []
    _ctrl_c_handler = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _ctrl_c_handler)
        _ctrl_c_handler = None
        if caught:
            signal.raise_signal(signal.SIGINT)  # now, under the handler the caller had


def _worker_main(fn, args, kwargs, rank, n, conn, stack_path, rendezvous, threads, collect,
                 shutdown):
    if _ctrl_c_handler is not None:  # forked inside `_ctrl_c_held`: the caller's handler back
        signal.signal(signal.SIGINT, _ctrl_c_handler)
    # Dump every thread's stack on SIGUSR1: the parent asks for it before ending a stuck rank.
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(n))
    code = 0
    try:
        import torch
        import torch.distributed as dist

        import phalanx.world.process as process
        import phalanx.world.runtime as runtime

        torch.set_num_threads(threads)
        process.reset()  # a forked child must not inherit the parent's job (process.py)
        if rendezvous.startswith("file://"):
            if n > 1:
                dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=n)
        else:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=rendezvous)
        runtime.init()
        result = fn(*args, **(kwargs or {}))
        payload = ("ok", result if collect == "all" or rank == 0 else None)
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises goes to the parent
        payload = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        code = 1
    try:
        conn.send_bytes(pickle.dumps(payload + (time.time(),)))
    except Exception as exc:  # noqa: BLE001 - the result itself did not pickle
        conn.send_bytes(pickle.dumps(("error", f"rank {rank}'s result could not be sent back: "
                                               f"{type(exc).__name__}: {exc}", time.time())))
        code = 1
    if code == 0:
        # See [Note: leaving together]: wait until every rank's result is in.
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            pass
    conn.close()
    if shutdown and code == 0:  # fn ran, so `runtime` is imported
        try:
            runtime.shutdown()
        except Exception:  # noqa: BLE001 - the result is delivered; a peer may be gone
            pass
    if code:  # a failed worker does not wait at its end for its peers (phalanx/leaving.py)
        with contextlib.suppress(Exception):
            sys.modules["phalanx.world.leaving"].failing()
    try:  # what a normal exit runs (files a writer still holds: px.log's TensorBoard events)
        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: a gloo group freed at exit can abort the process
    # (pytorch/pytorch#179291), and everything worth keeping is delivered.
    os._exit(code)


def run_workers(fn, n: int, args=(), kwargs=None, *, timeout: float | None = None,
                threads: int | None = None, rendezvous: str = "tcp", collect: str = "all",
                shutdown: bool = False, start_method: str | None = None) -> list:
    """Run `fn` on `n` processes and return what each returned (None for ranks other than 0
    with collect="rank0"). `rendezvous` is "tcp" (a free local port) or "file" (a file store:
    no ports, so parallel test runs never collide). Raises SpawnError / SpawnTimeout."""
    method = start_method or _start_method()
    ctx = mp.get_context(method)
    call = _by_value(fn, args, kwargs) if method != "fork" else None
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    tmp, lock = scratch.make("phalanx-workers-")  # [Note: a launcher's temporary directory]
    where = f"file://{os.path.join(tmp, 'store')}" if rendezvous == "file" else str(_free_port())
    procs, conns, stack_paths = [], [], []
    results, errors, done = [None] * n, {}, [False] * n
    stuck, stacks = [], {}
    try:
        for rank in range(n):
            recv, send = ctx.Pipe(duplex=True)
            stack_path = os.path.join(tmp, f"stack.{rank}")
            rest = (rank, n, send, stack_path, where, threads, collect, shutdown)
            if call is None:
                p = ctx.Process(target=_worker_main, name=f"rank{rank}",
                                args=(fn, args, kwargs) + rest)
            else:
                p = ctx.Process(target=_fresh_worker_main, name=f"rank{rank}",
                                args=(call,) + rest)
            with _ctrl_c_held():
                p.start()
                procs.append(p)
            send.close()
            conns.append(recv)
            stack_paths.append(stack_path)
        deadline = time.monotonic() + timeout if timeout is not None else None
        first_error_at = None
        while not all(done):
            now = time.monotonic()
            if (deadline is not None and now > deadline) or \
                    (first_error_at is not None and now - first_error_at > GRACE_S):
                break
            for rank, conn in enumerate(conns):
                if done[rank]:
                    continue
                if conn.poll(0.02):
                    try:
                        status, value, when = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        procs[rank].join(timeout=2)
                        status, value, when = "error", _died(procs[rank].exitcode, "before "
                                                             "sending a result"), time.time()
                    done[rank] = True
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors[rank] = (value, when)
                        first_error_at = first_error_at or time.monotonic()
                elif not procs[rank].is_alive() and not conn.poll(0):
                    done[rank] = True
                    errors[rank] = (_died(procs[rank].exitcode), time.time())
                    first_error_at = first_error_at or time.monotonic()
        if all(done) and not errors:  # see [Note: leaving together]
            for conn in conns:
                try:
                    conn.send_bytes(b"leave")
                except OSError:  # that worker is gone already
                    pass
            for p in procs:
                p.join(timeout=30)
        stuck = [r for r in range(n) if not done[r]]
        for r in stuck:
            if procs[r].is_alive():
                os.kill(procs[r].pid, signal.SIGUSR1)
        if stuck:
            time.sleep(0.5)
            for r in stuck:
                try:
                    with open(stack_paths[r]) as f:
                        stacks[r] = f.read().strip() or "(no stack was written)"
                except OSError:
                    stacks[r] = "(no stack was written)"
    finally:  # also on Ctrl-C: no worker outlives the call
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for c in conns:
            c.close()
        scratch.remove(tmp, lock)

    if errors:
        text = "\n".join(f"--- rank {r} failed:\n{errors[r][0]}" for r in _cause_first(errors))
        if stuck:
            text += "\n" + "\n".join(f"--- rank {r} was still running:\n{stacks[r]}"
                                     for r in stuck)
        raise SpawnError(f"{len(errors)} of {n} ranks failed\n{text}", sorted(errors))
    if stuck:
        text = "\n".join(f"--- rank {r} stack:\n{stacks[r]}" for r in stuck)
        raise SpawnTimeout(f"ranks {stuck} of {n} did not finish within {timeout:.0f} s\n{text}",
                           stuck)
    return results


# What a rank reports when a peer it was talking to went away: the consequence of another rank's
# failure, not a cause.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "connectFullMesh failed", "Socket Timeout", "the process died with exit code -9")


def _cause_first(errors: dict) -> list[int]:
    """Failed ranks, the likely cause first: a rank whose error is not the loss of a peer, then
    by when each failed (each worker stamps its failure)."""
    return sorted(errors, key=lambda r: (any(s in errors[r][0] for s in _PEER_GONE),
                                         errors[r][1], r))


def _died(exitcode, when: str = "") -> str:
    text = f"the process died with exit code {exitcode}"
    if exitcode is not None and exitcode < 0:
        try:
            text += f" (killed by {signal.Signals(-exitcode).name})"
        except ValueError:
            pass
    return text + (f" {when}" if when else "")
