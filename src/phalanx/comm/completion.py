"""Waiting for collectives, and knowing when they completed: the `Handle` every `Comm` method
returns (collectives.py).

[Note: completion on NCCL]
On gloo a work's future completes when the collective is done, and a blocking call returns
then. On NCCL both happen at enqueue: the future completes, and a blocking call (or a wait)
only makes the current stream wait for the communicator's. So on NCCL every collective, async
or blocking, is issued async and its work kept in its record's `pending` (records.py): a
blocking one is waited for here as a handle is, right after the call. Completion is then
stamped by whoever first sees `Work.is_completed()` (a non-blocking query of the device): a
later wait or poll of the handle, the hang watcher's tick or the step report's end, which poll
every record still in flight (records.py, [Note: records in flight]). It is never assumed at
enqueue, so a collective stuck on the device stays in flight where the hang watcher sees it.
How long compute stalled behind it is the time between two CUDA events around the wait.
"""

from __future__ import annotations

import datetime
import time

import torch

from .gate import continuing, gate, is_loss, lost, step_lost

__all__ = ["Handle", "wait_whole"]


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
        self.lost = False  # continue mode: the wait ended because the step was lost
        self.records = list(records)

    def _saw_completion(self) -> None:
        now = None
        for rec in self.records:
            if rec.completed is None:
                if rec.pending:  # NCCL: only the device knows (see [Note: completion on NCCL])
                    rec.poll()
                else:
                    now = now or time.perf_counter()
                    rec.completed = now

    def is_completed(self) -> bool:
        done = self._done or all(w.is_completed() for w in self.works)
        if done:
            self._saw_completion()
        return done

    def wait(self) -> bool:
        if not self._done:
            stalled = self.records[0].pending if self.records else None
            began = time.perf_counter()
            try:
                if stalled:  # NCCL: the wait is the current stream's, timed on the device
                    self.records[0].stall = _device_interval(
                        lambda: [w.wait() for w in self.works])
                elif continuing():  # see [Note: waiting on a group the others may have left]
                    for w in self.works:
                        _wait_or_give_up(w)
                else:
                    for w in self.works:
                        w.wait()
            except Exception as exc:  # see [Note: a collective on a broken group]
                if not is_loss(exc):
                    raise
                lost(exc)
                self._done = self.lost = True
                self.works = []  # their hold on the broken group's connections ends here
                return True
            self._saw_completion()
            if self.records:  # the exposed time, counted once for the handle's collectives
                self.records[0].waited += time.perf_counter() - began
            self._done = True
            if self._then is not None:
                self._then()
        return True


_LOST = "the step was lost before this collective completed"


def wait_whole(handle: Handle) -> None:
    """Wait for `handle` as a blocking collective does: its results are read next, so a
    wait that ended because the step was lost (continue mode) raises instead of returning
    unfilled buffers; the Comm method's guard (comm/cut.py) turns that into the result of
    a collective that moved nothing. Seen: a lost all-gather of pickle lengths read as
    garbage lengths, and the pickles after it failed to load."""
    handle.wait()
    if handle.lost:
        raise RuntimeError(_LOST)


_SLICE = datetime.timedelta(milliseconds=100)


def _wait_or_give_up(work) -> None:
    """[Note: waiting on a group the others may have left]
    Under `--on-failure continue` a wait is made in slices of 100 ms. Between two, a wait
    that the step has already lost (the wire was cut: comm/gate.py) or that the others have
    given up on (they went on after losing a rank and asked this one, through its hang watcher,
    to report: `gate.poked`) is abandoned as a failed collective. gloo fails a collective when a
    peer's connection closes, but a peer that left the group cannot always close it at once
    (torch._dynamo, imported by any optimizer, keeps references to every process group), and a
    rank waiting only on that peer would otherwise wait for the timeout."""
    while True:
        if step_lost():  # its buffers hold nothing: whoever reads them must know (Handle.lost)
            raise RuntimeError(_LOST)
        if gate.poked:
            raise RuntimeError("the other ranks went on without this one after a rank was lost")
        try:
            work.wait(timeout=_SLICE)
            return
        except RuntimeError as exc:
            if "timed out" not in str(exc):
                raise


def _device_interval(fn):
    """Run `fn` between two CUDA events on the current stream: how long the stream stalls
    there is the events' elapsed time, read once both have completed (never waited for)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    return start, end
