"""The step report: where the time, the bytes and the memory of each optimizer step went.

Data parallelism pays off when communication hides behind compute. A `StepClock` per prepared
model reads, for every optimizer step, what phalanx already knows, and adds no
synchronisation:

- wall: from the end of the previous `optimizer.step()` to the end of this one;
- forward: time inside the prepared model's forward calls (every micro-step);
- backward: from the first gradient at a model output to the end of backward (phalanx's
  end-of-backward callback, after the last bucket's collective was waited for);
- optimizer: from the end of the last backward to the end of `optimizer.step()` (clipping
  and anything the loop does there included);
- data: time spent waiting for the next batch of a `px.data_loader` (its iterator, timed);
- other: the rest of the wall time: the loop's own code, and loading data by other means;
- communication: the union of the intervals during which the step's collectives were in
  flight, from their records (records.py: issue time, and completion time read from the
  work's future when it completes on gloo, polled from the work without blocking on NCCL,
  never waited for), on every group the model issues on (the job's, and zero3's gathers);
  per kind, the collectives' count, bytes and algorithmic bandwidth (bytes over time in
  flight); and the bytes within a shard group and across groups (`intra_group_bytes`,
  `inter_group_bytes`: with `shard_size`, the replica group's and the job's group's count as
  across; without it everything is within the one group). A collective still in flight at
  the end of the step that issued it (a delayed DiLoCo average) counts in the step it
  completes in: its count and bytes, its time in flight from that step's start, and the
  waits for it;
- exposed communication: the time the training waited for a collective (the training
  thread blocked in a handle's wait or a blocking call; on NCCL, the compute stream's stall
  at a wait, from two CUDA events); overlap = (communication - exposed) / communication;
- throughput: samples (the first dimension of the forward's first tensor argument) and tokens
  (its element count, when it is an integer tensor of two or more dimensions) per second;
- offload (`px.prepare(..., offload=...)`, engine/offload.py): `host_step_s`, the time of the
  optimizer's step on the host (its kernels and the host's casts, part of `optimizer_s`), and
  `host_down_bytes` / `host_up_bytes`, what crossed the host link each way (gradients down; the
  updated parameters up, and under offload="params" each gather's shard);
- memory: resident memory now and the process's peak (CPU); on GPU, the memory allocated now,
  the peak allocated (`torch.cuda.max_memory_allocated()`: since the start, or since the
  user's own `reset_peak_memory_stats()`, which the report never calls) and the reserved
  memory.

On GPU the times are those of the host: kernels are asynchronous, so a forward's time is the
time to launch it unless something waited; wall time holds, and a collective's completion is
known to within the polling (at each wait, each hang-watcher tick and each step's end).

`px.step_stats(model)` returns the last step's report as a flat dict. With `all_ranks=True`
(a collective: every rank calls it) every rank's report is gathered and the straggler named:
`slowest_rank` is the rank that was busy longest (wall minus exposed communication: the one
the others waited for), `skew_s` how much longer it was busy than the least busy rank.
"""

from __future__ import annotations

import os
import resource
import time

import torch
from torch.autograd import Variable

from ..comm import records
from .trace import tracer

__all__ = ["StepClock", "step_stats"]

try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):
    _PAGE = 4096


def rss_bytes() -> int:
    """Resident memory of this process now (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (ru_maxrss: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_data_wait = [0.0]  # seconds spent waiting for batches of px.data_loader, ever


def add_data_wait(seconds: float) -> None:
    _data_wait[0] += seconds


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def _batch_size(args, kwargs) -> tuple[int, int]:
    """(samples, tokens) of one forward: from its first tensor argument."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            tokens = value.numel() if value.dim() >= 2 and not value.is_floating_point() \
                and not value.is_complex() else 0
            return value.shape[0], tokens
    return 0, 0


class StepClock:
    """Times one prepared model's steps (see the module's docstring)."""

    def __init__(self, comm, device: torch.device, steps: records.StepCounter,
                 groups: list | None = None, across: set | None = None):
        self.comm = comm
        self.across = across or set()  # names of groups that span shard groups (shard_size)
        self.steps = steps
        self.groups = groups if groups is not None else [comm.group]
        self.cuda = device.type == "cuda"
        self.last: dict | None = None
        self._start = time.perf_counter()
        self._data_at_start = _data_wait[0]
        self.trace = tracer(comm.rank)  # observe/trace.py: None unless PHALANX_TRACE asks
        self.extras: list = []  # fn() -> entries of the report (PowerSGD's bytes: powersgd.py)
        self._pending: list = []  # (record, its exposure counted) of collectives still in
        self._reset()             # flight at the end of the step that issued them

    def _reset(self) -> None:
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.samples = 0
        self.tokens = 0
        self._backward_from: float | None = None
        self._backward_end: float | None = None

    # -- called around the user's loop ----------------------------------------------------------
    def forward_done(self, began: float, args, kwargs) -> None:
        now = time.perf_counter()
        self.forward_s += now - began
        # A backward that raised never reached its end (the step vote, engine/vote.py): the
        # next one is timed from its own start.
        self._backward_from = None
        if self.trace is not None:
            self.trace.phase("forward", began, now, self.steps.value)
        samples, tokens = _batch_size(args, kwargs)
        self.samples += samples
        self.tokens += tokens

    def backward_started(self) -> None:
        """From the first output node of a backward: queue the end-of-backward callback after
        the engine's (which waits for the collectives), so the wait counts as backward."""
        if self._backward_from is None:
            self._backward_from = time.perf_counter()
            Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        now = time.perf_counter()
        if self._backward_from is not None:
            self.backward_s += now - self._backward_from
            if self.trace is not None:
                self.trace.phase("backward", self._backward_from, now,
                                 self.steps.value)
        self._backward_from = None
        self._backward_end = now

    def step_done(self) -> None:
        """After `optimizer.step()`: close the step and make its report."""
        now = time.perf_counter()
        wall = now - self._start
        optimizer = now - self._backward_end if self._backward_end is not None else 0.0
        issued = records.records_since(self.groups, self._start)
        carried = [r for r, _ in self._pending]
        records.poll_completions(issued + carried)
        done = [r for r in issued + carried if r.completed is not None]
        # a collective still in flight at its step's end (a delayed DiLoCo average) counts in
        # the step it completes in: its bytes, its time in flight within that step, and the
        # waits for it not counted yet
        counted = {id(r): already for r, already in self._pending}
        exposed = sum(r.exposed() - counted.get(id(r), 0.0) for r in issued + carried)
        self._pending = [(r, r.exposed()) for r in issued + carried if r.completed is None]
        data = min(_data_wait[0] - self._data_at_start, wall)
        comm = union_length([(max(r.started, self._start), r.completed) for r in done])
        kinds: dict[str, list] = {}
        for r in done:
            entry = kinds.setdefault(r.kind, [0, 0, 0.0])
            entry[0] += 1
            entry[1] += r.nbytes
            entry[2] += r.completed - r.started
        if self.trace is not None:
            if self._backward_end is not None:
                self.trace.phase("optimizer", self._backward_end, now, self.steps.value - 1)
            for r in sorted(done, key=lambda r: r.started):
                self.trace.collective(r)
        rss = rss_bytes()
        report = {
            "step": self.steps.value - 1,  # the index of this model's step, from 0
            "wall_s": wall,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_s": optimizer,
            "data_s": data,
            "other_s": max(wall - self.forward_s - self.backward_s - optimizer - data, 0.0),
            "comm_s": comm,
            "exposed_comm_s": min(exposed, wall),
            "overlap": (comm - min(exposed, comm)) / comm if comm > 0 else 0.0,
            "comm_bytes": sum(e[1] for e in kinds.values()),
            # shard_size (engine/hybrid.py): bytes within a shard group and across groups
            "inter_group_bytes": sum(r.nbytes for r in done if r.group in self.across),
            "samples": self.samples,
            "samples_per_s": self.samples / wall if wall > 0 else 0.0,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / wall if wall > 0 else 0.0,
            "rss_mb": rss / 2**20,
            "peak_rss_mb": max(peak_rss_bytes(), rss) / 2**20,
        }
        report["intra_group_bytes"] = report["comm_bytes"] - report["inter_group_bytes"]
        for kind, (count, nbytes, seconds) in sorted(kinds.items()):
            report[f"{kind}/count"] = count
            report[f"{kind}/bytes"] = nbytes
            report[f"{kind}/GBps"] = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        if self.cuda:  # the user's peak statistics are left alone: see the module's docstring
            report["gpu_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
            report["gpu_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
            report["gpu_reserved_mb"] = torch.cuda.memory_reserved() / 2**20
        for extra in self.extras:
            report.update(extra())
        self.last = report
        self._start = now
        self._data_at_start = _data_wait[0]
        self._reset()


def step_stats(clock: StepClock | None, all_ranks: bool = False) -> dict:
    if clock is None:
        raise ValueError("this model was prepared with step_stats=False: nothing was timed")
    report = dict(clock.last or {})
    if not all_ranks or clock.comm.group is None:
        return report
    busy = report.get("wall_s", 0.0) - report.get("exposed_comm_s", 0.0) if report else 0.0
    every = clock.comm.all_gather_object((busy, report.get("rss_mb", 0.0)),
                                         tag="step_stats")
    busy_by_rank = [b for b, _ in every]
    slowest = max(range(len(every)), key=lambda r: busy_by_rank[r])
    report["slowest_rank"] = slowest
    report["skew_s"] = busy_by_rank[slowest] - min(busy_by_rank)
    for r, (b, rss) in enumerate(every):
        report[f"rank{r}/busy_s"] = b
        report[f"rank{r}/rss_mb"] = rss
    return report

