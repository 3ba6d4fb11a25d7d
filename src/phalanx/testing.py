"""Run a function on N real processes (CPU, gloo) and collect what each rank returns.

This is the harness every multi-process test uses:

    results = run_ranks(fn, world_size=3, args=(...), timeout=60)

Each rank is a forked process that joins a gloo group through a file rendezvous (no ports, so
parallel test runs never collide), calls `fn(*args)` and sends back its return value. The
harness raises `RanksFailed` with the traceback of every rank that raised, and, when the run
outlives `timeout`, `RanksTimedOut` with the Python stack of every rank that was still running
(taken with faulthandler before the rank is killed). A dead or stuck rank therefore fails the
test within a second or two of its timeout; it never hangs the suite.

Fork, not spawn: a forked rank starts in milliseconds where a spawned one re-imports torch
(seconds on two cores). Ranks run with one intra-op thread, so a parent that already used
OpenMP threads does not matter to them.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback

__all__ = ["run_ranks", "RanksFailed", "RanksTimedOut"]


class RanksFailed(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class RanksTimedOut(RuntimeError):
    """The ranks did not finish in time; the message holds the stacks of the stuck ones."""


def _rank_main(fn, args, kwargs, rank, world_size, store_path, conn, stack_path, threads):
    # Dump every thread's stack on SIGUSR1: the parent asks for it before killing a stuck rank.
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if world_size > 1:
            dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                    world_size=world_size)
        import phalanx.runtime as runtime
        runtime._state.__init__()  # a forked child must not inherit the parent's world
        runtime.init()
        result = fn(*args, **kwargs)
        payload = ("ok", result)
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises goes to the parent
        payload = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        code = 1
    try:
        conn.send_bytes(pickle.dumps(payload))
    except Exception as exc:  # the result itself did not pickle
        conn.send_bytes(pickle.dumps(("error", f"rank {rank} result could not be sent: {exc}")))
        code = 1
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying a gloo group at exit can abort the process, and
    # the result is already delivered.
    os._exit(code)


def run_ranks(fn, world_size: int, args=(), kwargs=None, timeout: float = 120.0, threads: int = 1):
    """Run `fn(*args, **kwargs)` on `world_size` processes; return the list of results by rank."""
    kwargs = kwargs or {}
    ctx = mp.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="phalanx-ranks-")
    store_path = os.path.join(tmp, "store")
    procs, conns, stack_paths = [], [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        stack_path = os.path.join(tmp, f"stack.{rank}")
        p = ctx.Process(target=_rank_main, name=f"rank{rank}",
                        args=(fn, args, kwargs, rank, world_size, store_path, send, stack_path, threads))
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
        stack_paths.append(stack_path)

    results = [None] * world_size
    done = [False] * world_size
    errors = {}
    deadline = time.monotonic() + timeout
    first_error_at = None
    try:
        while not all(done):
            now = time.monotonic()
            # After the first failure give the others a moment to fail too (they usually hang in
            # a collective waiting for the dead rank), then stop waiting.
            if now > deadline or (first_error_at is not None and now - first_error_at > 3.0):
                break
            for rank, conn in enumerate(conns):
                if done[rank]:
                    continue
                if conn.poll(0.02):
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        procs[rank].join(timeout=2)
                        status, value = "error", (
                            f"the process died with exit code {procs[rank].exitcode}"
                            " before sending a result")
                    done[rank] = True
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors[rank] = value
                        first_error_at = first_error_at or time.monotonic()
                elif not procs[rank].is_alive() and not conn.poll(0):
                    done[rank] = True
                    errors[rank] = f"the process died with exit code {procs[rank].exitcode}"
                    first_error_at = first_error_at or time.monotonic()
        stuck = [r for r in range(world_size) if not done[r]]
        stacks = {}
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
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for c in conns:
            c.close()
        shutil.rmtree(tmp, ignore_errors=True)

    if errors:
        text = "\n".join(f"--- rank {r} failed:\n{errors[r]}" for r in sorted(errors))
        if stuck:
            text += "\n" + "\n".join(f"--- rank {r} was still running:\n{stacks[r]}" for r in stuck)
        raise RanksFailed(f"{len(errors)} of {world_size} ranks failed\n{text}")
    if stuck:
        text = "\n".join(f"--- rank {r} stack:\n{stacks[r]}" for r in stuck)
        raise RanksTimedOut(
            f"ranks {stuck} of {world_size} did not finish within {timeout:.0f} s\n{text}")
    return results
