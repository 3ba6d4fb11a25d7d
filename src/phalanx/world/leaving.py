"""A rank's end: one way out for every rank, whatever ends it, with its shards readable until its
peers are done with them.

[Note: a rank's end]
Under zero1, zero2 and zero3 a rank's peers may read its shards one-sidedly, from its shard
service thread ([Note: reading a peer's shards] in engine/remote.py): a torch DDP script's rank 0
saves `model.module.state_dict()` or evaluates under `torch.no_grad()` alone, after the other
ranks have finished their own loops. So a rank that has finished must not take its shards away
while a peer may still ask for them. A rank reaches its end in one of four ways, and each goes
through `leave` here:

- it calls `px.shutdown()`;
- it calls torch's `destroy_process_group()` for the whole job (no argument, or the WORLD
  group), as torch DDP scripts do last: while `px.init`'s group lives, that name in
  `torch.distributed` (and in `torch.distributed.distributed_c10d`) is a function that calls
  `px.shutdown()` and then torch's own for what is left (a group the script made); any other
  group goes straight to torch's. It is the one function of torch's that phalanx replaces
  besides `clip_grad_norm_` (engine/clipping.py), and torch's is put back by `px.shutdown()`;
- its script ends (returns from main, `sys.exit(0)`, the end of the file): `px.init` registers
  an `atexit` handler that calls `px.shutdown()` (under `--on-failure continue` too); if that
  raises, the process ends with exit status 1, the error said;
- it fails (an exception ends the script, or a launcher's worker exits with a non-zero status):
  it says so and leaves at once, without waiting for anyone.

A name bound before `px.init` (the tutorial's `from torch.distributed import
destroy_process_group`, at the top of the script) keeps torch's own function, which ends every
group torch lists. The shard service's channel is not one of them: it is a gloo group made
outside torch's registry (engine/remote.py), so such a rank still answers for its shards, and
its end is the exit that follows (or the next `px.init`/`px.prepare`, which notices that the
group it joined is gone and ends it as `px.shutdown()` would).

At its end a rank writes its key, `phalanx/leaving/<attempt>/<rank>`, in the job's store, with
how it ended ("px.shutdown", "failed", or how its script ended as a launcher's worker says:
"the script called sys.exit(0)"), and counts itself in (one atomic add). A rank that has not
failed then waits until the count is the world, its shard service answering meanwhile: a
peer's key is written after its last read (reads are synchronous), so when every rank is
counted nobody reads any more, and the groups can end with no peer still talking (what keeps
gloo from aborting a peer at exit). Nothing but each rank's own add is waited for (no key that
one rank writes for all after its add, which an exception or a stall between the two would
hold back), and a wait that outlasts the hang threshold says what it waits for, naming the
ranks, so an end that stalls is never silent. The wait is a poll of one store key, not a
collective: the hang watcher does not report it (a peer that is only slower is not a hang), but
a peer stuck in a collective that this rank will never join is still reported (faults/hangs.py:
the watcher keeps running until the wait is over), and soon: a collective that waits on a
peer whose key is written raises the hang flag after a few polls, not the threshold, and the
report says that this rank left early.

The wait is bounded by `px.init(timeout=)`: a peer that never comes (killed, or stuck outside
Python) costs its peers at most the timeout, after which each leaves with a message naming the
ranks it waited for. A store that has gone away (the process that hosted it has ended) ends the
wait at once: that process was the last to need it. Under a launcher, a killed worker makes the
launcher end the others sooner (phalanx run, torchrun, px.spawn).

Under `phalanx run --on-failure continue` none of this runs but the end of the script's call
of `px.shutdown()`: the ranks meet at px.shutdown's barrier, where a member lost after its last
step is recovered from (continuing/), and the agents record who has left (continuing/store.py).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .process import state

__all__ = ["call_at_exit", "caller_sets_exit_status", "done", "ended", "ending", "failing", "how",
           "leave", "shutdown_error", "start"]

_KEY = "phalanx/leaving"
_POLL_MIN, _POLL_MAX = 0.002, 0.1  # seconds between two looks at the store while waiting
# How the interpreter ends, kept for the process's life (not in state.leaving, which
# px.shutdown resets): read by `_at_exit` and by launch/worker.py after px.shutdown has run.
# "ending": how the script ended; "error": what px.shutdown raised there; "status_by_caller";
# "registered": `_at_exit` is registered with atexit (once per process, forked children too).
_script_end: dict = {}


def start(store, rank: int, world: int, timeout: float, end, said_after: float) -> None:
    """`px.init` with peers: this rank's end will be announced in `store` and waited for
    there; `end` (`px.shutdown`) is what the end of a script, or torch's
    `destroy_process_group()` for the whole job, calls; a wait at the end says what it waits
    for once it has lasted `said_after` seconds (the hang report's threshold). A key space
    per px.init: a store that outlives a shutdown and a new init (or a launcher's restart)
    holds the old keys."""
    attempt = (store.add(f"{_KEY}/joined", 1) - 1) // world
    now = state.leaving
    now.__init__(store=store, rank=rank, world=world, timeout=timeout, end=end,
                 prefix=f"{_KEY}/{attempt}", torch_destroy=now.torch_destroy,
                 said_after=said_after)
    call_at_exit(end)
    if now.torch_destroy is None:
        now.torch_destroy = c10d.destroy_process_group
        dist.destroy_process_group = c10d.destroy_process_group = _destroy_process_group


def call_at_exit(end) -> None:
    """Have the end of the script call `end` (`px.shutdown`) unless it failed: every
    `px.init` with peers, under `--on-failure continue` too, where nothing else of this
    module runs (its ranks meet at px.shutdown's barrier)."""
    state.leaving.at_exit = end
    if not _script_end.get("registered"):  # once per process (a forked child inherits it)
        atexit.register(_at_exit)
        _script_end["registered"] = True


def _destroy_process_group(group=None):
    # For the whole job, first this rank's end (px.shutdown(): see the Note); torch's own after.
    now = state.leaving
    original = now.torch_destroy or c10d.destroy_process_group
    if now.store is not None and not now.left and (group is None
                                                   or group is c10d.GroupMember.WORLD):
        now.end()
        if not dist.is_initialized():  # px.init made it, and px.shutdown ended it
            return None
    return original(group)


_destroy_process_group.__doc__ = c10d.destroy_process_group.__doc__


def _at_exit() -> None:
    """The script has ended without `px.shutdown()`: end as it would, or, on a failure, say so
    and leave at once (see the Note). A `px.shutdown()` that raises here (continue mode's
    check that the model holds what the loop took, for one) ends the process with exit
    status 1: the job did not complete. A launcher's worker reads that through
    `shutdown_error()` (launch/worker.py); any other process ends here, with its streams
    flushed, without the exit handlers registered before `px.init`."""
    now = state.leaving
    end, now.at_exit = now.at_exit, None
    if end is None:
        return
    if ending_on_failure():
        leave("failed")
        return
    rank = now.rank if now.store is not None else None
    try:
        end()
    except Exception as exc:  # noqa: BLE001 - said, as nothing is left to raise it to
        _script_end["error"] = exc
        who = "" if rank is None else f"rank {rank}: "
        print(f"phalanx: {who}px.shutdown() at the end of the script failed: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if not _script_end.get("status_by_caller"):
            sys.stdout.flush()
            os._exit(1)


def shutdown_error() -> BaseException | None:
    """The error `px.shutdown()` raised at the end of the script, if it did (then the
    process's exit status is 1)."""
    return _script_end.get("error")


def caller_sets_exit_status() -> None:
    """The caller runs the exit handlers and sets the exit status from `shutdown_error()`
    (launch/worker.py), so a failed `px.shutdown()` at the end does not end the process."""
    _script_end["status_by_caller"] = True


def ending(how_: str) -> None:
    """How the script ended ("the script called sys.exit(0)", from launch/worker.py): what
    this rank's key says at its end (`leave`), for a peer's hang report."""
    _script_end["ending"] = how_


def failing() -> None:
    """This process ends on a failure: its end will not wait for its peers (a launcher's
    worker says so before its `atexit` handlers run; see the Note)."""
    state.leaving.failing = True


def ending_on_failure() -> bool:
    """Whether this process is ending on a failure: `failing()` was called, or the interpreter
    is ending on an uncaught exception (it sets `sys.last_value` before the `atexit` handlers
    run; `sys.last_exc` from Python 3.12). A `sys.exit(1)` of a script run by plain `python`
    leaves no such trace: that rank waits for its peers as at a clean end, and a peer stuck in a
    collective with it ends the job by the hang report."""
    return state.leaving.failing or getattr(sys, "last_value", None) is not None \
        or getattr(sys, "last_exc", None) is not None


def how(rank: int) -> str | None:
    """How `rank` ended ("px.shutdown", "failed", or how its script ended: `ending`), or None
    while it has not (or unknown)."""
    store = state.leaving.store
    if store is None:
        return None
    key = f"{state.leaving.prefix}/{rank}"
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001 - the store is gone
        return None


def ended(ranks) -> list[int]:
    """Those of `ranks` that have reached their end. One look at the store while none has."""
    now = state.leaving
    if now.store is None:
        return []
    try:
        if now.store.add(f"{now.prefix}/count", 0) == 0:
            return []
    except Exception:  # noqa: BLE001 - the store is gone
        return []
    return [r for r in ranks if how(r) is not None]


def leave(how_: str) -> None:
    """This rank has reached its end (see the Note): announce it, and unless it fails, wait
    until every rank has, or the timeout passes. Once per `start`; a no-op without peers.

    What it waits for is the count every rank adds to (one atomic add of each), not a key
    that one of them writes after its add: no rank's later write, which an exception or a
    stall between the two could hold back, is needed for the others to go on. A wait that
    outlasts the hang threshold says so (`_poll`), naming the ranks it waits for."""
    now = state.leaving
    if now.store is None or now.left:
        return
    now.left = True
    fails = how_ == "failed" or ending_on_failure()
    store, prefix, world = now.store, now.prefix, now.world
    try:
        said = "failed" if fails else _script_end.get("ending", how_)
        store.set(f"{prefix}/{now.rank}", said)
        store.add(f"{prefix}/count", 1)
        if fails:  # it talks to nobody any more
            store.add(f"{prefix}/done", 1)
            return
    except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
        return
    came = _poll(lambda: store.add(f"{prefix}/count", 0) >= world,
                 lambda: _waiting_for(_not_ended(world)))
    if came is False:
        rank, timeout = now.rank, now.timeout
        missing = _not_ended(world)
        names = ", ".join(map(str, missing))
        who = f"rank {names} has" if len(missing) == 1 else f"ranks {names} have"
        print(f"phalanx: rank {rank} waited {timeout:.0f} s at its end for its peers to finish "
              f"reading its shards; {who} not reached "
              f"{'its' if len(missing) == 1 else 'their'} own end (px.shutdown() or the end "
              "of the script): killed, or stuck outside Python? Leaving without them "
              "(px.init(timeout=) bounds this wait)", file=sys.stderr, flush=True)


def _not_ended(world: int) -> list[int]:
    return [r for r in range(world) if r != state.leaving.rank and how(r) is None]


def _waiting_for(ranks: list[int]) -> str:
    one = len(ranks) == 1
    return (f"for {'rank' if one else 'ranks'} {', '.join(map(str, ranks))} to reach "
            f"{'its' if one else 'their'} own end (px.shutdown(), destroy_process_group() or "
            "the end of the script), answering for its shards meanwhile")


def done() -> None:
    """This rank's groups and shard services have ended: it says so (whether or not every
    peer came to its end: `leave`'s wait may have timed out). Rank 0, which may host the
    job's store (`phalanx run` and torchrun's env:// put it there), stays until every rank
    that reached its end has ended its own groups, which talk to the store as they end (a
    store that goes first makes torch print "Connection reset by peer" on each of them); a
    rank that never reached its end is not waited for again. Then torch's
    `destroy_process_group` is torch's again; px.shutdown's reset of the process state
    (process.py) forgets the rest, so the end of the script has nothing left to do."""
    now = state.leaving
    store, prefix = now.store, now.prefix
    try:
        if store is not None and now.left:
            count = store.add(f"{prefix}/done", 1)
            if now.rank == 0 and count < now.world:
                _poll(lambda: store.add(f"{prefix}/done", 0)
                      >= store.add(f"{prefix}/count", 0),
                      lambda: "for the ranks that reached their end to end their groups "
                              "(the job's store may be served by this process)")
    except Exception:  # noqa: BLE001 - the store is gone
        pass
    original, now.torch_destroy = now.torch_destroy, None
    if original is not None:
        for module in (dist, c10d):
            if module.destroy_process_group is _destroy_process_group:
                module.destroy_process_group = original


def _poll(ready, waiting_for=None) -> bool | None:
    """Look at `ready()` until it is true (True), the timeout passes (False), or the store has
    gone (None: its host has ended, and nobody reads any more). Past the hang threshold
    (faults/hangs.py: a third of the timeout by default) it says once what it waits for
    (`waiting_for()`, text after "waits at its end"): an end that stalls is never silent."""
    now = state.leaving
    began = time.monotonic()
    deadline = began + now.timeout
    said_at = began + now.said_after
    poll = _POLL_MIN
    while True:
        try:
            if ready():
                return True
        except Exception:  # noqa: BLE001
            return None
        moment = time.monotonic()
        if moment > deadline:
            return False
        if waiting_for is not None and moment > said_at:
            said_at = deadline + 1  # once
            try:
                what = waiting_for()
            except Exception:  # noqa: BLE001 - the store is gone: the next look ends the wait
                what = "for its peers"
            print(f"phalanx: rank {now.rank} has waited {moment - began:.0f} s at its end "
                  f"{what}; it waits up to px.init(timeout={now.timeout:.0f})",
                  file=sys.stderr, flush=True)
        time.sleep(poll)
        poll = min(2 * poll, _POLL_MAX)


def how_it_ended(exitcode: int) -> str:
    """A process's end in words, from its exit code: 'was killed by SIGKILL', 'exited with
    code 1'."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"
