"""One way to the wire: every collective phalanx issues goes through a `Comm`.

A `Comm` wraps one process group. Whoever issues collectives holds one (the engine, the data
helpers, sync BatchNorm, the consistency checks) and calls its methods; nothing else in phalanx
calls `torch.distributed` collectives. That gives three things one home:

- the choice of primitive per backend. On gloo (torch 2.13, CPU) one all-reduce of 50 MB took
  0.03 s where a reduce-scatter of the same buffer took 0.075 s, so on gloo a sharded reduction
  is an all-reduce whose owned slice is kept; on NCCL a reduce-scatter moves half the bytes.
  Likewise gloo's all-gather of a 50 MB fp32 buffer on 2 ranks took 70-150 ms where one
  broadcast per owner's shard took 12-35 ms (measured here), so on gloo an all-gather is done
  as broadcasts from each shard's owner. Tests pick a primitive with `Comm(group, prefer=...)`.
- the record. Each collective gets a `CollectiveRecord`: kind, sequence number, payload bytes,
  a tag naming what it serves (a bucket, a unit, a buffer broadcast), and its start and
  completion times. Completion is read from the work handle's future when it completes, never
  by waiting, so recording costs no synchronisation. The step report, hang diagnosis and the
  planner's measured-versus-predicted check read it.
- the version shims (`reduce_scatter_single` / `all_gather_single` in torch 2.13, the older
  `*_tensor` names before).

Payload bytes are the size of the tensor handed to the collective (for an all-gather, the
gathered output); what a ring moves on the wire is a multiple of it that depends on the
algorithm, which the planner accounts for.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
import zlib
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Comm", "CollectiveRecord", "Handle", "close_all", "comm_device",
           "bytes_by_kind", "reset_counts", "records_on", "records_since", "count_step",
           "CollectiveMismatch"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_OPS = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


@dataclass
class CollectiveRecord:
    seq: int                     # this Comm's count of collectives
    kind: str
    nbytes: int
    tag: str | None
    started: float               # time.perf_counter() when issued
    completed: float | None = None  # when the work completed (None while in flight)
    group_seq: int = 0           # the count on its process group, over every Comm of it
    step: int = 0                # optimizer steps taken in this process when it was issued
    waited: float = 0.0          # seconds the issuing thread was blocked waiting for it


class CollectiveMismatch(RuntimeError):
    """The ranks are about to issue different collectives (PHALANX_CHECK_COLLECTIVES=1)."""


# See [Note: checking collectives] (Comm._check_same).
CHECK_COLLECTIVES = os.environ.get("PHALANX_CHECK_COLLECTIVES", "") not in ("", "0")
_KIND_CODES = {kind: i for i, kind in enumerate(
    ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_gather_object",
     "gather_object", "barrier"], start=1)}

# Collectives issued on each process group (by id), over all the Comms that share it: every
# rank issues the same sequence on a group, so this number names one collective on every rank
# (the hang report compares ranks by it).
_group_seq: dict[int, int] = defaultdict(int)

# Optimizer steps taken in this process (every prepared optimizer's step counts; see
# engine.watch_steps), so that a record and a report can say at which step it happened.
steps_taken = 0


def count_step() -> None:
    global steps_taken
    steps_taken += 1


class Handle:
    """The works of one logical collective, waited for as one; `then` runs after the wait
    (the copy-out of a kept shard). Has `is_completed()` like a torch Work.

    For a work whose backend gives no future (gloo's reduce-scatter in torch 2.13 raises
    "Work::getFuture not implemented"), the record's completion is the first moment the
    handle saw it complete: when polled by `is_completed()` (the reducer polls in-flight
    buckets as gradients arrive) or when waited for.
    """

    def __init__(self, works, then=None, records=()):
        self.works = [w for w in works if w is not None]
        self._then = then
        self._done = False
        self.records = list(records)

    def _saw_completion(self) -> None:
        now = None
        for rec in self.records:
            if rec.completed is None:
                now = now or time.perf_counter()
                rec.completed = now

    def is_completed(self) -> bool:
        done = self._done or all(w.is_completed() for w in self.works)
        if done:
            self._saw_completion()
        return done

    def wait(self) -> bool:
        if not self._done:
            began = time.perf_counter()
            for w in self.works:
                w.wait()
            self._saw_completion()
            if self.records:  # the exposed time, counted once for the handle's collectives
                self.records[0].waited += time.perf_counter() - began
            self._done = True
            if self._then is not None:
                self._then()
        return True


_live: "weakref.WeakSet[Comm]" = weakref.WeakSet()
_twin_groups: dict = {}  # a process group -> the group of its twins (Comm.twin)


class Comm:
    """Collectives over one process group (`group=None`: a world of one, where every call is
    a no-op that leaves its tensors as they are).

    `prefer` picks primitives where several would do: "reduce_scatter" or "all_reduce" for a
    sharded reduction, "all_gather" or "broadcast" for gathering shards. None (the default)
    picks by backend, as measured above.
    """

    def __init__(self, group, *, prefer: tuple[str, ...] | str | None = None, history: int = 4096):
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.backend = str(dist.get_backend(group)) if group is not None else "none"
        prefer = (prefer,) if isinstance(prefer, str) else tuple(prefer or ())
        gloo = self.backend == "gloo"
        self.uses_reduce_scatter = ("reduce_scatter" in prefer
                                    or (not gloo and "all_reduce" not in prefer))
        self.gathers_by_broadcast = ("broadcast" in prefer
                                     or (gloo and "all_gather" not in prefer))
        self.records: deque[CollectiveRecord] = deque(maxlen=history)
        self.bytes_by_kind: dict[str, int] = defaultdict(int)
        self.seq = 0
        self.tag: str | None = None  # a default tag for calls that name none
        _live.add(self)

    def twin(self) -> "Comm":
        """A Comm over the same ranks, with the same choice of primitives, on a process group
        of its own: what is issued on it is a sequence of its own, ordered apart from this
        one's (zero3's gathers beside the reductions, engine/zero3.py). Only the ranks of
        this group take part in making it, once per group and process: every later twin of
        the same group shares it (each model's gathers are the same on every rank, so one
        sequence holds them all), so preparing model after model does not add groups."""
        if self.group is None:
            return self
        group = _twin_groups.get(self.group)
        if group is None:
            group = dist.new_group(dist.get_process_group_ranks(self.group),
                                   use_local_synchronization=True)
            _twin_groups[self.group] = group
        twin = Comm(group)
        twin.uses_reduce_scatter = self.uses_reduce_scatter
        twin.gathers_by_broadcast = self.gathers_by_broadcast
        return twin

    # -- bookkeeping ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where tensors for this group's collectives must live (NCCL: this rank's GPU)."""
        if "nccl" in self.backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _begin(self, kind: str, nbytes: int, tag) -> CollectiveRecord:
        """The record of a collective about to be issued: made before the call, so that a rank
        blocked inside it shows as having entered it."""
        self.seq += 1
        key = id(self.group)
        _group_seq[key] += 1
        rec = CollectiveRecord(self.seq, kind, nbytes, tag if tag is not None else self.tag,
                               time.perf_counter(), group_seq=_group_seq[key], step=steps_taken)
        self.records.append(rec)
        self.bytes_by_kind[kind] += nbytes
        if CHECK_COLLECTIVES:
            self._check_same(rec)
        return rec

    def _check_same(self, rec: CollectiveRecord) -> None:
        """[Note: checking collectives] With PHALANX_CHECK_COLLECTIVES=1, before each
        collective the ranks exchange what they are about to issue (kind, size, tag) and raise
        `CollectiveMismatch` on every rank when they differ. A skipped, extra or reordered
        collective otherwise hangs (then faults/hangs.py names it) or, when sizes differ,
        aborts gloo natively with no word of which collective. The exchange makes every
        collective wait for every rank, so it is a debugging mode (as TORCH_DISTRIBUTED_DEBUG=
        DETAIL is for torch's), off by default."""
        device = comm_device(self.group)
        tag = (rec.tag or "").encode()
        mine = torch.tensor([rec.group_seq, _KIND_CODES.get(rec.kind, 0), rec.nbytes,
                             zlib.crc32(tag)], dtype=torch.int64, device=device)
        every = torch.empty(self.world * 4, dtype=torch.int64, device=device)
        _all_gather(every, mine, group=self.group)
        rows = every.view(self.world, 4).tolist()
        if all(row == rows[0] for row in rows):
            return
        about = (rec.kind, rec.tag, rec.nbytes, steps_taken)
        parts = [None] * self.world
        dist.all_gather_object(parts, about, group=self.group)
        by_what: dict = defaultdict(list)
        for r, (kind, tag, nbytes, step) in enumerate(parts):
            by_what[(kind, tag, nbytes)].append((r, step))
        described = "; ".join(
            f"rank{'s' if len(who) > 1 else ''} {', '.join(str(r) for r, _ in who)} "
            f"{'issue' if len(who) > 1 else 'issues'} {kind} ({tag}, {nbytes} bytes) at step "
            f"{who[0][1]}"
            for (kind, tag, nbytes), who in by_what.items())
        raise CollectiveMismatch(
            f"the ranks disagree on collective #{rec.group_seq}: {described}. Every rank must "
            "issue the same collectives in the same order: look for a collective under a "
            "rank-dependent condition, or ranks that run different numbers of steps or batches "
            "(px.data_loader gives every rank the same number)")

    @staticmethod
    def _track(rec: CollectiveRecord, work) -> CollectiveRecord:
        """Note the completion: now for a call that returned (`work` None), else when the
        work's future completes."""
        if work is None:  # a blocking call: all of it was waited for
            rec.completed = time.perf_counter()
            rec.waited = rec.completed - rec.started
        else:
            def done(_fut, rec=rec):
                # The first sign of completion wins: the future's callback can run after a
                # wait() already saw the work complete (a busy machine schedules it late).
                if rec.completed is None:
                    rec.completed = time.perf_counter()
            try:
                work.get_future().add_done_callback(done)
            except (RuntimeError, AttributeError):  # a backend without futures
                pass
        return rec

    def _add_bytes(self, rec: CollectiveRecord, nbytes: int) -> None:
        """Bytes of a record known only once part of it ran (the object collectives)."""
        rec.nbytes += nbytes
        self.bytes_by_kind[rec.kind] += nbytes

    def reset_counts(self) -> None:
        self.bytes_by_kind.clear()

    def close(self) -> None:
        """Drop the process group, so nothing here keeps it alive past `px.shutdown()`."""
        self.group = None
        self.world, self.rank = 1, 0

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    # -- tensor collectives ----------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "avg", async_op: bool = False,
                   tag: str | None = None):
        """Reduce `tensor` over the ranks, in place ("avg" divides inside the collective, so
        no extra pass over the buffer is needed)."""
        if self.group is None:
            return Handle([]) if async_op else None
        rec = self._begin("all_reduce", self._nbytes(tensor), tag)
        with _label(rec):
            work = dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=async_op)
        self._track(rec, work)
        return Handle([work], records=[rec]) if async_op else None

    def reduce_shard(self, full: torch.Tensor, out: torch.Tensor, async_op: bool = True,
                     tag: str | None = None):
        """Average `full` over the ranks and leave this rank's 1/N slice in `out`.

        By reduce-scatter (`full` untouched), or by all-reduce of `full` in place and a copy of
        the owned slice, as the backend prefers. The copy happens when the handle is waited.
        """
        if self.group is None:
            out.copy_(full)
            return Handle([])
        if self.uses_reduce_scatter:
            rec = self._begin("reduce_scatter", self._nbytes(full), tag)
            with _label(rec):
                work = _reduce_scatter(out, full, op=dist.ReduceOp.AVG, group=self.group,
                                       async_op=True)
            self._track(rec, work)
            handle = Handle([work], records=[rec])
        else:
            rec = self._begin("all_reduce", self._nbytes(full), tag)
            with _label(rec):
                work = dist.all_reduce(full, op=dist.ReduceOp.AVG, group=self.group,
                                       async_op=True)
            self._track(rec, work)
            n = out.numel()
            lo = self.rank * n
            handle = Handle([work], then=lambda: out.copy_(full[lo:lo + n]), records=[rec])
        if not async_op:
            handle.wait()
        return handle

    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                        tag: str | None = None):
        """Concatenate every rank's `shard` into `output`, in rank order."""
        if self.group is None:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return Handle([]) if async_op else None
        rec = self._begin("all_gather", self._nbytes(output), tag)
        with _label(rec):
            if not self.gathers_by_broadcast:
                work = _all_gather(output, shard, group=self.group, async_op=True)
                works = [work]
            else:
                pieces = output.chunk(self.world)
                if pieces[self.rank].data_ptr() != shard.data_ptr():
                    pieces[self.rank].copy_(shard)
                works = [dist.broadcast(piece, src=dist.get_global_rank(self.group, r),
                                        group=self.group, async_op=True)
                         for r, piece in enumerate(pieces)]
                work = works[-1]
        self._track(rec, work)
        handle = Handle(works, records=[rec])
        if not async_op:
            handle.wait()
            return None
        return handle

    def all_gather_list(self, tensor: torch.Tensor, tag: str | None = None) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape everywhere), in rank order."""
        if self.group is None:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        rec = self._begin("all_gather", self._nbytes(tensor) * self.world, tag)
        dist.all_gather(parts, tensor, group=self.group)
        self._track(rec, None)
        return parts

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False,
                  tag: str | None = None):
        """Rank `src`'s (a rank of this group) `tensor` on every rank, in place."""
        if self.group is None:
            return Handle([]) if async_op else None
        rec = self._begin("broadcast", self._nbytes(tensor), tag)
        with _label(rec):
            work = dist.broadcast(tensor, src=dist.get_global_rank(self.group, src),
                                  group=self.group, async_op=async_op)
        self._track(rec, work)
        return Handle([work], records=[rec]) if async_op else None

    # -- object collectives and barrier ------------------------------------------------------
    # Objects travel as pickles in byte tensors, as torch.distributed's object collectives
    # do, but made here so that the record holds the bytes that really moved: one all-gather
    # of the pickles' lengths, then one of the pickles padded to the longest; both are one
    # record, whose bytes count the lengths and every rank's padded pickle.
    def all_gather_object(self, obj, tag: str | None = None) -> list:
        """Every rank's picklable `obj`, in rank order."""
        if self.group is None:
            return [obj]
        rec = self._begin("all_gather_object", 0, tag)
        payload, sizes = self._pickle_and_sizes(obj)
        longest = int(max(sizes))
        self._add_bytes(rec, (8 + longest) * self.world)
        parts = [torch.empty(longest, dtype=torch.uint8, device=payload.device)
                 for _ in range(self.world)]
        dist.all_gather(parts, _padded(payload, longest), group=self.group)
        self._track(rec, None)
        return [_unpickle(part, size) for part, size in zip(parts, sizes)]

    def gather_object(self, obj, dst: int = 0, tag: str | None = None) -> list | None:
        """Every rank's `obj` on rank `dst` (a rank of this group; None elsewhere)."""
        if self.group is None:
            return [obj]
        rec = self._begin("gather_object", 0, tag)
        payload, sizes = self._pickle_and_sizes(obj)
        longest = int(max(sizes))
        self._add_bytes(rec, (8 + longest) * self.world)
        parts = None
        if self.rank == dst:
            parts = [torch.empty(longest, dtype=torch.uint8, device=payload.device)
                     for _ in range(self.world)]
        dist.gather(_padded(payload, longest), parts, dst=dist.get_global_rank(self.group, dst),
                    group=self.group)
        self._track(rec, None)
        if parts is None:
            return None
        return [_unpickle(part, size) for part, size in zip(parts, sizes)]

    def _pickle_and_sizes(self, obj) -> tuple[torch.Tensor, list[int]]:
        """This rank's pickle as a byte tensor, and every rank's pickle length."""
        device = comm_device(self.group)
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=self.group)
        return payload, [int(s.item()) for s in sizes]

    def barrier(self, tag: str | None = None) -> None:
        if self.group is None:
            return
        rec = self._begin("barrier", 0, tag)
        if "nccl" in self.backend:
            dist.barrier(group=self.group, device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier(group=self.group)
        self._track(rec, None)


_profiling = torch._C._autograd._profiler_enabled
_NO_LABEL = contextlib.nullcontext()


def _label(rec: CollectiveRecord):
    """Under torch.profiler, name the issue of a collective `phalanx::TAG::KIND`, so a profiler
    trace shows which bucket or unit it served (observe/trace.py); nothing otherwise (0.1 us)."""
    if not _profiling():
        return _NO_LABEL
    return torch.profiler.record_function(f"phalanx::{rec.tag or 'collective'}::{rec.kind}")


def _padded(payload: torch.Tensor, length: int) -> torch.Tensor:
    if payload.numel() == length:
        return payload
    out = torch.zeros(length, dtype=torch.uint8, device=payload.device)
    out[:payload.numel()] = payload
    return out


def _unpickle(part: torch.Tensor, size: int):
    return pickle.loads(part[:size].cpu().numpy().tobytes())


def comm_device(group) -> torch.device:
    """Where tensors for collectives on `group` must live: the GPU under NCCL, else the CPU."""
    if group is None:
        return torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def close_all() -> None:
    """Make every live `Comm` drop its group (called by `px.shutdown()` before the group is
    destroyed, so no engine keeps it alive into interpreter finalisation)."""
    for comm in list(_live):
        comm.close()
    _group_seq.clear()


def records_since(group, since: float) -> list[CollectiveRecord]:
    """The records over `group` of collectives issued at or after `since` (perf_counter),
    read from the newest backwards, so the cost is that of the records returned."""
    out = []
    if group is None:
        return out
    for comm in list(_live):
        if comm.group is not group:
            continue
        for rec in reversed(comm.records):
            if rec.started < since:
                break
            out.append(rec)
    return out


def records_on(group) -> list[CollectiveRecord]:
    """The recent records of every live `Comm` over `group`, in the group's order."""
    out = [rec for comm in list(_live) if comm.group is group and group is not None
           for rec in list(comm.records)]
    return sorted(out, key=lambda rec: rec.group_seq)


def bytes_by_kind() -> dict[str, int]:
    """Payload bytes by collective kind, summed over every live `Comm` of this process (what
    the planner's communication figures are checked against)."""
    total: dict[str, int] = defaultdict(int)
    for comm in list(_live):
        for kind, n in comm.bytes_by_kind.items():
            total[kind] += n
    return dict(total)


def reset_counts() -> None:
    for comm in list(_live):
        comm.reset_counts()
