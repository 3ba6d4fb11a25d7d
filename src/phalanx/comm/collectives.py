"""One way to the wire: every collective phalanx issues goes through a `Comm`.

A `Comm` wraps one process group. Whoever issues collectives holds one (the engine, the data
helpers, sync BatchNorm, the consistency checks) and calls its methods; nothing else in phalanx
calls `torch.distributed` collectives. That gives three things one home:

- the choice of primitive per backend. On gloo (torch 2.13, CPU) one all-reduce of 50 MB took
  0.03 s where a reduce-scatter of the same buffer took 0.075 s, so on gloo a sharded reduction
  is an all-reduce whose owned slice is kept; on NCCL a reduce-scatter moves half the bytes.
  Likewise gloo's all-gather of a 50 MB fp32 buffer on 2 ranks took 70-150 ms where one
  broadcast per owner's shard took 12-35 ms (measured here), so on gloo an all-gather is done
  as broadcasts from each shard's owner, except under `--on-failure continue` ([Note: an
  all-gather a loss cannot tie]). Tests pick a primitive with `Comm(group, prefer=...)`.
- the record (records.py): kind, sequence number, payload bytes, a tag naming what it serves
  (a bucket, a unit, a buffer broadcast), its group's name, its start and completion times.
  Completion is read from the work's future when it completes (gloo), or polled from the work
  without blocking (NCCL, whose futures and blocking calls return at enqueue, so there even a
  blocking collective is issued async, waited for and polled: [Note: completion on NCCL] in
  completion.py), never by waiting, so recording costs no synchronisation. The step report,
  hang diagnosis and the planner's check read it.
- the version shims (`reduce_scatter_single` / `all_gather_single` in torch 2.13, the older
  `*_tensor` names before).

Payload bytes are the size of the tensor handed to the collective (for an all-gather, the
gathered output); what a ring moves on the wire is a multiple of it that depends on the
algorithm, which the planner accounts for.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections import defaultdict, deque

import torch
import torch.distributed as dist

from . import groups, pickled, records
from .completion import Handle, wait_whole
from .cut import guarded as _guarded, nothing as _nothing, own_shard as _own_shard
from .gate import continuing
from .mismatch import CHECK_COLLECTIVES, KIND_CODES, CollectiveMismatch, mismatch
from .records import CollectiveRecord

__all__ = ["Comm", "Handle", "CollectiveMismatch", "JobEnded"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_OPS = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


class JobEnded(RuntimeError):
    """A collective, or a read of a peer's shards, after the job's end (every rank called
    `px.shutdown()` or torch's `destroy_process_group()`): the peers it needs have ended."""


class Comm:
    """Collectives over one process group (`group=None`: a world of one, where every call is
    a no-op that leaves its tensors as they are).

    `prefer` picks primitives where several would do: "reduce_scatter" or "all_reduce" for a
    sharded reduction, "all_gather" or "broadcast" for gathering shards. None (the default)
    picks by backend, as measured above. `name` names the group on every rank (see [Note:
    groups by name] in records.py); `steps` is the step counter of the model the Comm serves
    (see [Note: steps per model]).
    """

    def __init__(self, group, *, prefer: tuple[str, ...] | str | None = None, history: int = 4096,
                 name: str | None = None, steps: records.StepCounter | None = None,
                 device: torch.device | None = None):
        self.group = group
        self.name = name or _group_name(group)
        self.steps = steps
        # continuing/: a Comm of the job's group between two generations (or of a replacement
        # not yet admitted) waits without a group for the next; `regroups` counts its groups
        self.waiting = False
        self.regroups = 0
        self.ended = False  # px.shutdown() ended its group: see `close`
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.backend = str(dist.get_backend(group)) if group is not None else "none"
        # Where this group's tensors live: NCCL's GPU (read once, not per call from whichever
        # thread calls), else the CPU, or the GPU px.init(device=...) gives gloo ranks.
        self.device = torch.device(device) if device is not None else _default_device(self)
        self.prefer = (prefer,) if isinstance(prefer, str) else tuple(prefer or ())
        self._choose_primitives()
        self.records: deque[CollectiveRecord] = deque(maxlen=history)
        self.bytes_by_kind: dict[str, int] = defaultdict(int)
        self.seq = 0
        # On NCCL a work's future completes when the work is enqueued, not when it is done, so
        # completion is polled from the work (a non-blocking query of the device) instead.
        self.polls = "nccl" in self.backend
        self.in_flight: list[CollectiveRecord] = []  # polled records not yet seen complete
        records.register(self)

    def _choose_primitives(self) -> None:
        """See the module docstring: by `prefer`, else by the backend.

        [Note: an all-gather a loss cannot tie]
        Under `--on-failure continue` (continuing/) an all-gather on gloo is gloo's own, a ring,
        not one broadcast per owner of a shard, for what each leaves behind when a rank dies.
        A survivor destroys its end of the group at the loss ([Note: generations] in
        continuing/membership.py), and gloo's destruction of a group first runs every collective
        still queued on it and joins its worker threads; only then does it close the
        connections, which is what makes a peer's receive from this rank fail. A broadcast
        whose root fails on its send to the dead rank need not deliver to the other ranks (a
        failed gloo collective drops what it has not sent), and an all-gather by broadcasts
        has a root on every rank: each of two survivors can be left receiving the other's
        shard, each then waits in its destruction for the other to close, and both hang there,
        silently, until the collective timeout (600 s by default). Seen under zero3 whenever
        several all-gathers were in flight at the loss (a unit holding frozen parameters is
        two; a root entered late gathers its units at once: zero3_roots.py): PEFT's LoRA
        shape killed before a forward, 5 of 5 jobs; a frozen base killed in its backward, 1
        of 5 (tests/test_keep_going_frozen.py). In a ring each rank receives from the rank
        before it and sends to the one after, so the neighbours of a dead rank fail at once
        in every collective (their send or receive meets the closed connection), and every
        other survivor waits only along the ring, towards one of them: nobody waits on a rank
        that is waiting on it, and the destructions end one after the other. The price is the
        ring's speed on gloo (the module docstring); NCCL's all-gather is its own anyway, and
        `prefer="broadcast"` is honoured, ties and all.
        """
        prefer, gloo = self.prefer, self.backend == "gloo"
        self.uses_reduce_scatter = ("reduce_scatter" in prefer
                                    or (not gloo and "all_reduce" not in prefer))
        self.gathers_by_broadcast = ("broadcast" in prefer
                                     or (gloo and "all_gather" not in prefer
                                         and not continuing()))

    def apart(self, purpose: str, backend: str | None = None) -> "Comm":
        """A Comm over the same ranks, with the same choice of primitives, on a process group
        of its own for `purpose` (groups.py): what is issued on it is a sequence of its own,
        ordered apart from this one's (zero3's gathers beside the reductions,
        engine/zero3.py). Made once per group and purpose, shared by every later user."""
        group = groups.group_for(self.group, purpose, backend) if self.group is not None else None
        apart = Comm(group, name=purpose,
                     steps=self.steps, device=self.device if backend is None else None)
        apart.uses_reduce_scatter = self.uses_reduce_scatter
        apart.gathers_by_broadcast = self.gathers_by_broadcast
        return apart

    # -- bookkeeping ---------------------------------------------------------------------
    def _begin(self, kind: str, nbytes: int, tag) -> CollectiveRecord:
        """The record of a collective about to be issued: made before the call, so that a rank
        blocked inside it shows as having entered it."""
        self.seq += 1
        step = self.steps.value if self.steps is not None else records.current_step()
        rec = CollectiveRecord(self.seq, kind, nbytes, tag, time.perf_counter(),
                               group_seq=records.next_seq(self.group), step=step,
                               group=self.name)
        self.records.append(rec)
        self.bytes_by_kind[kind] += nbytes
        if CHECK_COLLECTIVES:
            self._check_same(rec)
        return rec

    def _check_same(self, rec: CollectiveRecord) -> None:
        """See [Note: checking collectives] in comm/mismatch.py."""
        tag = (rec.tag or "").encode()
        mine = torch.tensor([rec.group_seq, KIND_CODES.get(rec.kind, 0), rec.nbytes,
                             zlib.crc32(tag)], dtype=torch.int64, device=self.device)
        every = torch.empty(self.world * 4, dtype=torch.int64, device=self.device)
        _all_gather(every, mine, group=self.group)
        rows = every.view(self.world, 4).tolist()
        if all(row == rows[0] for row in rows):
            return
        parts = [None] * self.world
        dist.all_gather_object(parts, (rec.kind, rec.tag, rec.nbytes, rec.step),
                               group=self.group)
        raise mismatch(rec.group_seq, parts)

    def _track(self, rec: CollectiveRecord, work) -> CollectiveRecord:
        """Note the completion: now for a call that returned (`work` None: never on NCCL, see
        `_issue`), else when the work's future completes, or on NCCL when the work is seen
        completed (polled by every wait, and by the hang watcher and the step report until it
        is: [Note: records in flight] in records.py)."""
        if work is None:  # a blocking call: all of it was waited for
            rec.completed = time.perf_counter()
            rec.waited = rec.completed - rec.started
        elif self.polls:
            rec.pending.append(work)
            records.add_in_flight(self, rec)
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

    def _issue(self, rec: CollectiveRecord, call, async_op: bool):
        """Make `call(async_op)`, the torch.distributed call of `rec`'s collective, and track its
        work: a Handle when `async_op`, else None once the collective is waited for. gloo's
        blocking call returns when the collective is done; NCCL's at enqueue, so there a blocking
        collective is issued async and waited for as a handle (see [Note: completion on NCCL])."""
        # NCCL, and continue mode (see [Note: waiting on a group the others may have left])
        waits_here = not async_op and (self.polls or continuing())
        with _label(rec):
            work = call(async_op or waits_here)
        self._track(rec, work)
        if not (async_op or waits_here):
            records.note_blocking_done(self.group)
            return None
        handle = Handle([work], records=[rec])
        if waits_here:
            wait_whole(handle)
            records.note_blocking_done(self.group)
        return handle if async_op else None

    def _add_bytes(self, rec: CollectiveRecord, nbytes: int) -> None:
        """Bytes of a record known only once part of it ran (the object collectives)."""
        rec.nbytes += nbytes
        self.bytes_by_kind[rec.kind] += nbytes

    def reset_counts(self) -> None:
        self.bytes_by_kind.clear()

    def regroup(self, group, name: str | None = None) -> None:
        """Issue on `group` from now on: the group of a new generation of the job's members
        under `--on-failure continue` (continuing/membership.py), or the first group of a
        replacement, whose Comms wait without one until it is admitted (`world`, `rank`:
        what they will be). Records and counts are kept."""
        self.group = group
        self.regroups += 1
        self.name = name or _group_name(group)
        self.world = dist.get_world_size(group) if group is not None else self.world
        self.rank = dist.get_rank(group) if group is not None else self.rank
        self.backend = str(dist.get_backend(group)) if group is not None else self.backend
        self.polls = "nccl" in self.backend
        self._choose_primitives()  # a replacement's Comm had no backend while it waited
        records.drop_in_flight(self)

    def close(self) -> None:
        """Drop the process group, so nothing here keeps it alive past `px.shutdown()`. A
        Comm that had peers is then ended: a collective on it raises `JobEnded` (see
        `_alone`) instead of doing what a world of one does, which is nothing."""
        self.ended = self.ended or self.group is not None
        self.group = None
        self.world, self.rank = 1, 0
        records.drop_in_flight(self)

    def _alone(self) -> bool:
        """Whether this Comm has nobody to talk to (a world of one: every collective is a
        no-op). A Comm whose peers have ended (`close`) raises instead: a training step, a
        zero3 gather or a buffer broadcast after the end would otherwise go on as if this
        rank were the whole job, computing something else than the job without a word."""
        if self.group is not None:
            return False
        if self.ended:
            raise JobEnded(f"a collective ({self.name}) after this job's end: every rank "
                           "called px.shutdown() or torch's destroy_process_group(), and the "
                           "peers that would take part have ended. Train, evaluate and take "
                           "the state (state_dict(), optimizer.state_dict()) before the end")
        return True

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    # -- tensor collectives ----------------------------------------------------------------
    @_guarded(lambda self, tensor, op='avg', async_op=False, tag=None:
              _nothing(self, async_op=async_op))
    def all_reduce(self, tensor: torch.Tensor, op: str = "avg", async_op: bool = False,
                   tag: str | None = None):
        """Reduce `tensor` over the ranks, in place ("avg" divides inside the collective, so
        no extra pass over the buffer is needed)."""
        if self._alone():
            return Handle([]) if async_op else None
        rec = self._begin("all_reduce", self._nbytes(tensor), tag)
        return self._issue(rec, lambda a: dist.all_reduce(tensor, op=_OPS[op], group=self.group,
                                                          async_op=a), async_op)

    @_guarded(_own_shard)
    def reduce_shard(self, full: torch.Tensor, out: torch.Tensor, async_op: bool = True,
                     tag: str | None = None):
        """Average `full` over the ranks and leave this rank's 1/N slice in `out`.

        By reduce-scatter (`full` untouched), or by all-reduce of `full` in place and a copy of
        the owned slice, as the backend prefers. The copy happens when the handle is waited.
        """
        if self._alone():
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
            wait_whole(handle)
        return handle

    @_guarded(lambda self, output, shard, async_op=False, tag=None:
              _nothing(self, async_op=async_op))
    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                        tag: str | None = None):
        """Concatenate every rank's `shard` into `output`, in rank order."""
        if self._alone():
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
            wait_whole(handle)
            return None
        return handle

    @_guarded(lambda self, tensor, tag=None: [tensor] * self.world)
    def all_gather_list(self, tensor: torch.Tensor, tag: str | None = None) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape everywhere), in rank order."""
        if self._alone():
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        rec = self._begin("all_gather", self._nbytes(tensor) * self.world, tag)
        self._issue(rec, lambda a: dist.all_gather(parts, tensor, group=self.group, async_op=a),
                    False)
        return parts

    @_guarded(lambda self, tensor, src=0, async_op=False, tag=None:
              _nothing(self, async_op=async_op))
    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False,
                  tag: str | None = None):
        """Rank `src`'s (a rank of this group) `tensor` on every rank, in place."""
        if self._alone():
            return Handle([]) if async_op else None
        rec = self._begin("broadcast", self._nbytes(tensor), tag)
        root = dist.get_global_rank(self.group, src)
        return self._issue(rec, lambda a: dist.broadcast(tensor, src=root, group=self.group,
                                                         async_op=a), async_op)

    @_guarded(lambda self, output, tensor, output_splits, input_splits, async_op=False,
              tag=None: _nothing(self, async_op=async_op))
    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], async_op: bool = False, tag: str | None = None):
        """Send `tensor[sum(input_splits[:r]):][:input_splits[r]]` to rank r, and receive rank
        r's part for this rank into the same place of `output` by `output_splits` (both 1-D).
        Rank r's input_splits[me] must equal this rank's output_splits[r]. The record's bytes
        are what this rank sends."""
        if self._alone():
            output.copy_(tensor)
            return Handle([]) if async_op else None
        rec = self._begin("all_to_all", self._nbytes(tensor), tag)
        return self._issue(rec, lambda a: dist.all_to_all_single(
            output, tensor, list(output_splits), list(input_splits), group=self.group,
            async_op=a), async_op)

    # -- object collectives and barrier ------------------------------------------------------
    # Objects travel as pickles in byte tensors, as torch.distributed's object collectives
    # do, but made here so that the record holds the bytes that really moved: one all-gather
    # of the pickles' lengths, then one of the pickles padded to the longest; both are one
    # record, whose bytes count the lengths and every rank's padded pickle.
    @_guarded(lambda self, obj, tag=None: [obj] * self.world)
    def all_gather_object(self, obj, tag: str | None = None) -> list:
        """Every rank's picklable `obj`, in rank order."""
        if self._alone():
            return [obj]
        rec = self._begin("all_gather_object", 0, tag)
        payload, sizes = self._pickle_and_sizes(obj)
        longest = int(max(sizes))
        self._add_bytes(rec, (8 + longest) * self.world)
        parts = [torch.empty(longest, dtype=torch.uint8, device=payload.device)
                 for _ in range(self.world)]
        padded = pickled.padded(payload, longest)
        self._issue(rec, lambda a: dist.all_gather(parts, padded, group=self.group, async_op=a),
                    False)
        out = [pickled.loads(part, size) for part, size in zip(parts, sizes)]
        rec.poll()  # NCCL: the host has read the parts, so the device is done with them
        return out

    @_guarded(lambda self, obj, dst=0, tag=None: [obj] * self.world if self.rank == dst else None)
    def gather_object(self, obj, dst: int = 0, tag: str | None = None) -> list | None:
        """Every rank's `obj` on rank `dst` (a rank of this group; None elsewhere)."""
        if self._alone():
            return [obj]
        rec = self._begin("gather_object", 0, tag)
        payload, sizes = self._pickle_and_sizes(obj)
        longest = int(max(sizes))
        self._add_bytes(rec, (8 + longest) * self.world)
        parts = None
        if self.rank == dst:
            parts = [torch.empty(longest, dtype=torch.uint8, device=payload.device)
                     for _ in range(self.world)]
        padded, root = pickled.padded(payload, longest), dist.get_global_rank(self.group, dst)
        self._issue(rec, lambda a: dist.gather(padded, parts, dst=root, group=self.group,
                                               async_op=a), False)
        if parts is None:
            return None  # NCCL: polled until seen complete, as any record in flight
        out = [pickled.loads(part, size) for part, size in zip(parts, sizes)]
        rec.poll()
        return out

    def _pickle_and_sizes(self, obj) -> tuple[torch.Tensor, list[int]]:
        """This rank's pickle as a byte tensor, and every rank's pickle length."""
        device = self.device if "nccl" in self.backend else torch.device("cpu")
        data = pickled.dumps(obj)  # tensors of any device travel as CPU tensors
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.world)]
        wait_whole(Handle([dist.all_gather(sizes, size, group=self.group, async_op=True)]))
        return payload, [int(s.item()) for s in sizes]

    @_guarded(_nothing)
    def barrier(self, tag: str | None = None) -> None:
        if self._alone():
            return
        rec = self._begin("barrier", 0, tag)
        ids = {"device_ids": [self.device.index]} if "nccl" in self.backend else {}
        self._issue(rec, lambda a: dist.barrier(group=self.group, async_op=a, **ids), False)


_profiling = torch._C._autograd._profiler_enabled
_NO_LABEL = contextlib.nullcontext()


def _label(rec: CollectiveRecord):
    """Under torch.profiler, name the issue of a collective `phalanx::TAG::KIND`, so a profiler
    trace shows which bucket or unit it served (observe/trace.py); nothing otherwise (0.1 us)."""
    if not _profiling():
        return _NO_LABEL
    return torch.profiler.record_function(f"phalanx::{rec.tag or 'collective'}::{rec.kind}")


def _group_name(group) -> str:
    if group is None:
        return "none"
    if group is dist.group.WORLD:
        return "world"
    return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))


def _default_device(comm) -> torch.device:
    if "nccl" in comm.backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
