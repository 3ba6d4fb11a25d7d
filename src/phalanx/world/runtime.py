"""The process world: who am I, how many are we, which device is mine.

`init()` reads the environment that a launcher leaves behind (world/launch_env.py: `phalanx run`,
`torchrun`, SLURM's `srun`) and joins the process group; with none of them the world is one
process, and no process group is created at all, so the same script runs unchanged under plain
`python script.py`.

This module keeps the world: rank, device, the job's group and its Comm, the hang watcher,
in its part of the process state (process.py). Everything else receives its process group (or
a Comm) explicitly. `shutdown()` ends what runs and resets the whole process state: see
[Note: process-wide state] in process.py, which lists what is kept per process and where.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..comm import continuation, groups, records
from ..comm.collectives import Comm
from ..faults.hangs import HangWatch, hang_threshold
from . import environment, leaving, process
from .init_options import check_backend as _check_backend, check_timeout as _check_timeout
from .launch_env import check_slurm_tasks, read_launch_env
from .processes import auto_processes, process_count, relaunch as _relaunch

__all__ = [
    "init", "rank", "world_size", "local_rank", "device", "is_main", "barrier", "shutdown",
    "default_group", "default_comm", "job_comm", "is_distributed",
    "auto_processes", "process_count",
]


def _requested_device(device) -> str | None:
    """`px.init(device=...)`, else PHALANX_DEVICE, as a string ("cpu", "cuda", "cuda:1"...)."""
    if device is None:
        return environment.value("PHALANX_DEVICE")
    try:
        return str(torch.device(device))
    except (RuntimeError, TypeError):
        raise ValueError(f"px.init(device={device!r}): a device such as 'cpu', 'cuda' or "
                         "'cuda:1'") from None


def _pick_device(local_rank: int, backend: str | None, requested: str | None = None
                 ) -> torch.device:
    """This rank's device: `requested` (see `init`), else this rank's GPU under NCCL and the
    CPU otherwise; a CUDA device is made the current one."""
    nccl = backend is not None and "nccl" in str(backend)
    if requested is None:
        requested = "cuda" if nccl and torch.cuda.is_available() else "cpu"
    dev = torch.device(requested)
    if dev.type == "cpu":
        if nccl:
            raise ValueError("px.init: NCCL communicates CUDA tensors only, and this rank's "
                             "device is the CPU; use backend='gloo' for CPU ranks")
        return dev
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"px.init: device {requested!r} asked for, but this process sees no "
                         "GPU (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    index = dev.index if dev.index is not None else local_rank
    if index >= count and nccl:
        raise ValueError(
            f"px.init: the rank with LOCAL_RANK {local_rank} needs GPU {index}, but this node "
            f"has {count} GPU{'s' if count != 1 else ''}; NCCL needs one GPU per process (it "
            f"refuses two on one GPU: 'Duplicate GPU detected'). Start at most {count} workers "
            f"per node (phalanx run -n {count}), or let ranks share GPUs through gloo: "
            "px.init(backend='gloo', device='cuda') or PHALANX_DEVICE=cuda")
    index %= count  # gloo ranks may share a GPU
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init(backend: str | None = None, timeout: float = 600.0, processes=None,
         hang_after: float | None = None, device=None) -> None:
    """Join the job's process group (idempotent). With no launcher, a world of one.

    `backend=None` picks PHALANX_BACKEND if set, else NCCL when CUDA is available and gloo
    otherwise (px.spawn's and phalanx run's workers read the variable too). `timeout` (seconds, or
    a `datetime.timedelta`) is the one setting for waiting: the process group's connection and
    every collective are bounded by it, and a collective that has waited `hang_after` seconds
    (default: a third of `timeout`, or PHALANX_HANG_AFTER) ends the job with a hang report
    that names the rank and the collective, before the bare timeout would.
    If a process group already exists (a test harness or the user made one), it is adopted.
    `processes=N` (or "auto", or the environment variable PHALANX_PROCESSES) in a script started
    with plain `python`: this process becomes `phalanx run -n N` of the same script and
    arguments, so the script runs as N workers; under a launcher it is ignored.
    `device` (or PHALANX_DEVICE): "cuda" (this rank's GPU, cuda:LOCAL_RANK, shared round-robin
    when gloo ranks outnumber the GPUs), "cuda:N", or "cpu"; default: this rank's GPU under
    NCCL, the CPU under gloo. Gloo ranks with device="cuda" compute on the GPU and talk through
    gloo's CUDA support, so several ranks can share one GPU, which NCCL refuses: useful to test
    several ranks on a machine with one GPU, not for speed.
    """
    me = process.state.world
    timeout = _check_timeout(timeout)
    if not me.initialized or _world_gone():  # See [Note: one table of variables]
        environment.check()
    requested = _requested_device(device)
    if backend is None:
        backend = environment.value("PHALANX_BACKEND")  # checked as it is read
    else:
        _check_backend(backend)
    if hang_after is not None:
        hang_after = _check_timeout(hang_after).total_seconds()
    if me.initialized:
        if not _world_gone():
            return
        shutdown()  # the script destroyed the group this process joined: start afresh
    if processes is None:
        processes = environment.value("PHALANX_PROCESSES")
    if processes is not None and not (dist.is_available() and dist.is_initialized()) \
            and read_launch_env().source == "none":
        _relaunch(processes)
    if dist.is_available() and dist.is_initialized():
        backend_in_use = dist.get_backend()
        env = read_launch_env()
        me.rank = dist.get_rank()
        me.world_size = dist.get_world_size()
        if env.source != "none":
            me.local_rank = env.local_rank
            me.device = _pick_device(me.local_rank, backend_in_use, requested)
        else:  # a group made by the user (mp.spawn...): keep the device they chose
            me.local_rank = torch.cuda.current_device() \
                if backend_in_use != "gloo" and torch.cuda.is_available() else 0
            me.device = _pick_device(me.local_rank, backend_in_use, requested)
        me.initialized = True
        me.owns_group = False
        _joined(timeout, hang_after)
        return
    env = read_launch_env()
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise ValueError(f"invalid launch environment: rank {env.rank} of {env.world_size}")
    check_slurm_tasks(env)
    if backend is None:
        on_gpu = requested is None or requested.startswith("cuda")
        backend = "nccl" if torch.cuda.is_available() and on_gpu else "gloo"
    me.rank, me.world_size, me.local_rank = env.rank, env.world_size, env.local_rank
    me.device = _pick_device(env.local_rank, backend, requested)
    if env.world_size > 1 and continuation.wanted(env):  # phalanx run --on-failure continue
        me.initialized = True
        me.owns_group = True
        me.watch = (timeout, hang_after)
        groups.set_timeout(timeout)
        continuation.start(env, backend, timeout, me.device, regrouped=_regrouped,
                           lost=_stop_watching)
        leaving.call_at_exit(shutdown)  # the end of the script calls px.shutdown()
        if not continuation.now().joining():  # a replacement: watched once it is admitted
            _watch_hangs(timeout, hang_after)
        return
    if env.world_size > 1:
        if env.source == "slurm":
            os.environ.setdefault("MASTER_ADDR", env.master_addr)
            os.environ.setdefault("MASTER_PORT", str(env.master_port))
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = me.device
        dist.init_process_group(
            backend=backend,
            store=_store_for_this_init(env, timeout),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            **kwargs,
        )
        me.owns_group = True
    me.initialized = True
    _joined(timeout, hang_after)


# The launcher's store, for the process's life (px.shutdown does not forget it): see
# `_store_for_this_init`. "store": the env:// store; "inits": the px.init calls made over it.
_launch_store: dict = {}


def _store_for_this_init(env, timeout: datetime.timedelta):
    """[Note: one store, a key space per px.init]
    The job's group is made over the launcher's store (env://: MASTER_ADDR and MASTER_PORT,
    served by rank 0's process under `phalanx run` and torchrun's static rendezvous, by the
    agent under its own store). A script may end its group and make another in the same
    processes (torch's DDP tutorial's rounds: `destroy_process_group()`, then `px.init()`
    again). torch then makes the store again on rank 0's port; a server of the first round
    still alive in rank 0's process (torch's stores are multi-tenant: the second round reuses
    it) answers the second round's ranks with the first round's keys, and gloo dialled a
    listener that had closed, until the job's timeout (a second px.init under phalanx run hung
    in 5 of 5 runs). So the store is made once per process, kept, and each px.init's group
    lives under a prefix of its own: the rounds count alike on every rank (each rank runs the
    same script)."""
    if "store" not in _launch_store:
        store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size,
                                           timeout=timeout))
        _launch_store.update(store=store, inits=0)
    _launch_store["inits"] += 1
    return dist.PrefixStore(f"phalanx/init{_launch_store['inits']}", _launch_store["store"])


def _joined(timeout: datetime.timedelta, hang_after: float | None) -> None:
    """After joining a group (ours or the user's), outside continue mode: bound what waits by
    `timeout`, watch for hangs, and have this rank's end wait for its peers' (leaving.py)."""
    me = process.state.world
    groups.set_timeout(timeout)
    _watch_hangs(timeout, hang_after)
    if me.world_size > 1 and dist.is_initialized():
        me.world = dist.group.WORLD
        try:
            store = dist.distributed_c10d._get_default_store()
        except (ValueError, RuntimeError, AttributeError):  # a group made without a store
            return
        watch = me.hang_watch  # a wait at the end says what it waits for past its threshold
        leaving.start(store, me.rank, me.world_size, timeout.total_seconds(), shutdown,
                      said_after=watch.threshold if watch is not None
                      else timeout.total_seconds() / 3)


def _world_gone() -> bool:
    """Whether the script destroyed the group this process joined (torch's
    `destroy_process_group()`, as the tutorial's rounds do before making the next): `px.init`
    (and `px.prepare`, which calls it) then ends the old one as `px.shutdown` would and starts
    afresh."""
    me = process.state.world
    return me.world is not None and not (dist.is_available() and dist.is_initialized()
                                             and dist.group.WORLD is me.world)


def _watch_hangs(timeout: datetime.timedelta, hang_after: float | None) -> None:
    """Start this rank's hang watcher (faults/hangs.py) when there are peers to wait for."""
    me = process.state.world
    if me.world_size < 2 or not dist.is_initialized():
        return
    threshold = hang_after if hang_after is not None else hang_threshold(timeout.total_seconds())
    if threshold is None:  # PHALANX_HANG_AFTER=off
        return
    try:
        store = dist.distributed_c10d._get_default_store()
    except (ValueError, RuntimeError, AttributeError):  # a group made without a store
        return
    watch = me.hang_watch = HangWatch(store, me.rank, me.world_size, threshold)
    # under continue mode: [Note: a member left behind], [Note: a member that hangs] (continuing/)
    continuation.now().watch_hangs(watch)


def _regrouped(rank: int, world: int) -> None:
    """A new generation's group (continuing/membership.py): this rank's place in it, and a hang
    watcher over it (the old one stopped when the old group broke)."""
    me = process.state.world
    me.rank, me.world_size = rank, world
    me.comm = None
    _stop_watching()
    if me.watch is not None:
        _watch_hangs(*me.watch)


def job_comm(**kwargs) -> Comm:
    """A new Comm over the job's group; for a replacement not yet admitted (continuing/), one
    that waits without a group, sized as the job, until its admission gives it one."""
    if continuation.now().joining():
        comm = Comm(None, device=device(), **kwargs)
        me = process.state.world
        comm.world, comm.rank, comm.waiting = me.world_size, me.rank, True
        return comm
    return Comm(default_group(), device=device(), **kwargs)


def _ensure():
    if not process.state.world.initialized:
        init()


def rank() -> int:
    """This process's rank in the job (0 when not distributed)."""
    _ensure()
    return process.state.world.rank


def world_size() -> int:
    """Number of processes in the job (1 when not distributed)."""
    _ensure()
    return process.state.world.world_size


def local_rank() -> int:
    """This process's index on its own machine."""
    _ensure()
    return process.state.world.local_rank


def device() -> torch.device:
    """`cuda:LOCAL_RANK` on a GPU machine, `cpu` otherwise."""
    _ensure()
    return process.state.world.device


def is_main() -> bool:
    """True on rank 0: the process that should print, save exports and write reports."""
    return rank() == 0


def is_distributed() -> bool:
    """True when there is more than one process and a process group to talk over."""
    _ensure()
    return process.state.world.world_size > 1 and dist.is_initialized()


def default_group():
    """The job's process group (the WORLD group), or None in a world of one."""
    return dist.group.WORLD if is_distributed() else None


def default_comm() -> Comm:
    """The `Comm` of the job's default group (a world of one: a Comm over no group)."""
    group = default_group()
    me = process.state.world
    if me.comm is None or me.comm.group is not group:
        me.comm = job_comm()
    return me.comm


def barrier() -> None:
    """Wait until every rank gets here. A no-op in a world of one."""
    _barrier("px.barrier")


def _barrier(tag: str) -> None:
    if is_distributed():
        default_comm().barrier(tag=tag)


_before_shutdown: list = []


def before_shutdown(fn) -> None:
    """Have `px.shutdown()` call `fn()` first, while the process group still works (a
    checkpoint being written in the background finishes there)."""
    if fn not in _before_shutdown:
        _before_shutdown.append(fn)


def shutdown() -> None:
    """Leave the job and end its groups. Safe to call twice and in a world of one; the end of a
    script that does not call it calls it (at the interpreter's exit).

    A checkpoint still being written in the background is finished first (its error, if it had
    one, is raised after the groups are ended). Then this rank waits, answering for its shards,
    until every rank has reached its own end (`px.shutdown()`, the end of its script, or a
    failure) or `px.init(timeout=)` has passed; under `--on-failure continue` the ranks meet
    at a barrier instead, where a loss after the last step is recovered from. Either way no
    rank tears its connections down while another still talks to it, the ordering that keeps
    gloo from aborting a peer at exit. Then every `Comm` drops its group, the groups phalanx
    made (zero3's gathers, background saves) and the shard services end, and so does the
    job's group when `init` made it (one the user made is theirs to end), so the groups
    end here, with their native threads, and are not left for interpreter finalisation to free
    (where gloo's threads can abort the process; pytorch/pytorch#179291). A group that the
    script already destroyed (torch's `destroy_process_group()`) is left alone.
    """
    if not process.state.world.initialized:
        return
    error = None
    try:
        for fn in list(_before_shutdown):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - raised once the group is ended
                error = error or exc
        continuation.now().finish()  # phalanx run --on-failure continue: a loss after the last step
        if not continuation.continuing():
            leaving.leave("px.shutdown")
        elif dist.is_available() and dist.is_initialized():
            _barrier("px.shutdown")
            continuation.now().finish()  # ... or in this very barrier
    finally:
        _stop_watching()
        try:
            _end_groups()
        finally:
            try:
                leaving.done()
                continuation.now().stop()
            finally:
                process.reset()  # [Note: process-wide state] in process.py
    if error is not None:
        raise error


def _stop_watching() -> None:
    me = process.state.world
    if me.hang_watch is not None:
        me.hang_watch.stop()
        me.hang_watch = None


def _end_groups() -> None:
    records.close_all()
    groups.end_all()
    me = process.state.world
    if me.owns_group and dist.is_initialized() and (
            me.world is None or dist.group.WORLD is me.world):  # not a newer one
        dist.destroy_process_group()
