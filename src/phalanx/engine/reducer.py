"""Overlapping gradient reduction with backward: hooks, launch order, end of backward.

`GradReducer` is the mechanism that every strategy shares. It registers a post-accumulate-grad
hook on each trainable parameter. When a parameter's gradient is complete, the hook makes the
bucket's view its `.grad`, copying a freshly made gradient in (with `zero_grad()` setting
gradients to None, autograd makes a fresh tensor each step; later micro-steps of accumulation
add into the view in place); when every gradient of a
bucket is there, the bucket is handed to the strategy's `launch` (an asynchronous all-reduce or
reduce-scatter) while autograd goes on with the rest of the graph. At the end of backward (a
callback queued on the autograd engine) any bucket not yet launched is launched, every
collective still in flight is waited for, and the strategy's `finish` turns each reduced bucket
into what the optimizer reads. After `loss.backward()` returns, gradients are final.

[Note: one launch order on every rank]
Collectives on one process group must be issued in the same order by every rank. Gradients
do not become ready in the same order everywhere (an unused branch on one rank, different
control flow), so a bucket is launched only when it is complete AND every bucket before it has
been launched; stragglers are launched, in bucket order, at the end of backward.

[Note: the end of the outermost backward]
The end-of-backward callback is queued from a gradient hook on the prepared model's outputs,
which runs first in the backward that the user started. Queued from a parameter's hook
instead, it could land in a nested backward (reentrant activation checkpointing runs one per
checkpointed segment) and reduce everything while the outer backward still has gradients to
deliver. The parameter hooks queue it only when no output hook did (the user differentiated
the unwrapped module directly).

[Note: gradients that never arrived]
A parameter that got no gradient on this rank (unused this iteration, or its branch not taken)
has no hook call. When its bucket is launched its slot is zeroed, so it counts as zero in the
mean, exactly as in one process over the whole batch. Whether it got a gradient on ANY rank is
learned from the flags that ride in the bucket (see buckets.py); a parameter that got none
anywhere keeps `.grad = None`, as it would in a single process, so the optimizer skips it (no
weight decay, momentum or step count touches it), under every strategy and precision.

[Note: launch order follows readiness]
Buckets are laid out by module (units.py), in reverse registration order. After the first
backward, rank 0's order of bucket completion is broadcast and becomes every rank's launch
order, so a bucket whose gradients arrive early is not held behind one that arrives late (a
tied embedding, a module called out of registration order). Only the order of launches
changes; the layout of the buckets and of the units stays.

[Note: a backward that raised]
A backward that raises (and is caught, as loops that skip a batch on out-of-memory do) leaves
this iteration's state behind: `in_progress()` stays True, the end-of-backward callback having
never run. The rank's next call into its model finds it there, and `end_backward()` completes
the step's collectives with that rank's signal saying it failed, so that every rank drops the
step (see [Note: the step vote] in vote.py). For that vote to have a carrier, the last bucket
in launch order is launched at the end of backward only, never by a hook: a backward that
raised has always left it unlaunched. After the first step the launch order is the order in
which rank 0's buckets filled, so that bucket is the last to fill there, and its launch waits
only for what autograd still does after its last gradient. The callback is queued for a backward
under `no_sync` too (where it only notes the end), so that a failed accumulation micro-step is seen
as well.

[Note: waiting for a reduction in backward]
Waiting for a bucket's reduction blocks this rank until every rank has issued it, and a rank
issues buckets in one order, each once it holds all of its gradients: one that got no gradient
for some parameter (a branch taken on the other ranks only) issues that bucket, and every one
after it, at the end of its backward. Under zero2 that end comes whatever this rank does. Under
zero3 the peer's backward first gathers the roots still to come, and each gather needs this
rank, blocked, to join it: both would wait forever (it did, with a branch on the rank in the
first root of backward and three units after it). So zero3 waits in the middle of a backward
only for a bucket whose flags collective (reduced apart, buckets.py) has completed, which it
does once every rank has issued it, hence the gradients' collective before it: that one then
completes with nothing more from this rank. Before a root makes its gradients (zero3.py), a
rank gives the flags 50 ms to show it (a peer a little behind), once per backward; what it
cannot show safe stays in flight (memory, never a hang) and the end of backward waits for all.
On NCCL a wait holds the current stream, not the host, which goes on issuing its gathers: the
bound on buckets in flight waits as under zero2, and nothing is waited for before a root (its
device would wait for the reduction instead of computing beside it).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable

import torch
from torch.autograd import Variable

from .buckets import GradBucket

__all__ = ["GradReducer"]


class GradReducer:
    """Moves gradients into buckets as they become ready and reduces each bucket when complete.

    `launch(bucket)` starts the bucket's collective and returns its work handle (or None);
    `finish(bucket)` runs after the handle completed: during backward for buckets whose
    collective is already done, at the end of backward for the rest. `max_in_flight` bounds the
    buckets reduced but not yet finished (ZeRO-2 frees a bucket in `finish`, so this bounds its
    peak gradient memory); None lets backward run on without ever waiting. `may_wait(bucket,
    patience)`, where given, says whether a bucket in flight may be waited for in the middle of
    a backward (zero3 on gloo: see [Note: waiting for a reduction in backward]); without it
    every bucket may.
    `on_first_order(buckets)` is called once, after the first backward, with the buckets in
    the order they became complete on this rank (see [Note: launch order follows readiness]).
    """

    def __init__(self, buckets: list[GradBucket], launch: Callable, finish: Callable,
                 on_first_order: Callable | None = None, max_in_flight: int | None = None,
                 signal: Callable | None = None, on_end: Callable | None = None,
                 may_wait: Callable | None = None):
        self._launch_fn = launch
        self._finish_fn = finish
        self._signal = signal    # what each bucket's signal slot carries (faults/nonfinite.py)
        self._on_end = on_end    # called last at the end of each backward that communicated
        self._on_first_order = on_first_order
        self._max_in_flight = max_in_flight
        self._may_wait = may_wait
        self.sync = True
        self.pass_sync = True  # whether the backward in progress communicates (not no_sync)
        self._disarmed = False
        self.set_buckets(buckets)
        # The hook holds the reducer weakly: a hook is kept by the parameter in C++, where the
        # garbage collector cannot see a cycle back to the parameter, so a bound method here
        # would keep the reducer, the engine and the model alive forever (measured: a prepared
        # model was never freed).
        hook = _weak_hook(self)
        for bucket in buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(hook)
        self._ready_order: list | None = [] if on_first_order else None

    def disarm(self) -> None:
        """Let the parameters' hooks do nothing from now on (the engine is being replaced:
        the hooks stay on the parameters, holding this reducer weakly)."""
        self._disarmed = True

    def first_order_pending(self) -> bool:
        """Whether the next backward still has to decide the launch order."""
        return self._ready_order is not None

    def rearm_first_order(self) -> None:
        """Settle the launch order again at the next backward (its broadcast was lost)."""
        self._ready_order = [] if self._on_first_order is not None else None

    def adopt_order(self, indexes: list[int]) -> None:
        """Launch in the order of `indexes`, the one rank 0 settled (also for a rank that joins
        the job later: continuing/joining.py)."""
        by_index = {b.index: b for b in self.buckets}
        self.set_buckets([by_index[i] for i in indexes])
        self._ready_order = None

    def set_buckets(self, buckets: list[GradBucket]) -> None:
        """The buckets, in launch order (their `index` names them and does not change)."""
        self.buckets = buckets
        self._where = {p: (b, i) for b in buckets for i, p in enumerate(b.params)}
        self._reset_iteration()

    def in_progress(self) -> bool:
        """True between the first gradient of a backward and its end (or a raise inside it)."""
        return bool(self._seen or self._next or self._in_flight or self._callback_queued)

    def drain(self) -> None:
        """Wait for the collectives still in flight (so peers that issued them too finish)."""
        for _, work in self._in_flight:
            if work is not None:
                work.wait()

    def abandon(self) -> None:
        """Forget a backward that raised, where nothing of it is to be sent (under `no_sync`,
        or in a world of one)."""
        self._reset_iteration()
        if self._ready_order is not None:
            self._ready_order = []

    def _reset_iteration(self) -> None:
        self._ready = {b.index: 0 for b in self.buckets}
        self._seen: set[int] = set()
        self._next = 0
        self._in_flight: list[tuple[GradBucket, object]] = []
        self._callback_queued = False

    @contextmanager
    def no_sync(self):
        """Accumulate gradients in the buckets without communicating."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    # -- hooks ---------------------------------------------------------------------------
    def backward_started(self) -> None:
        """Called from the outputs' gradient hooks. See [Note: the end of the outermost
        backward] and, for a backward under `no_sync`, [Note: a backward that raised]."""
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
            self.pass_sync = self.sync

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket, i = self._where[param]
        self._adopt_grad(bucket, i)
        if not self.sync:
            return
        self.backward_started()
        if id(param) in self._seen:  # a second backward through the same graph (reentrant)
            return
        self._seen.add(id(param))
        self._ready[bucket.index] += 1
        if self._ready_order is not None and self._ready[bucket.index] == len(bucket.params):
            self._ready_order.append(bucket)
        # the last one waits for the end of backward: see [Note: a backward that raised]
        while (self._next < len(self.buckets) - 1
               and self._ready[self.buckets[self._next].index]
               == len(self.buckets[self._next].params)):
            self._launch(self.buckets[self._next])
            self._next += 1
        self._finish_in_flight()

    def _finish_in_flight(self, all_of_them: bool = False) -> None:
        """Finish, oldest first, the buckets whose collective is done or over the bound; with
        `all_of_them`, wait for every one."""
        while self._in_flight:
            bucket, work = self._in_flight[0]
            over = self._max_in_flight is not None and len(self._in_flight) > self._max_in_flight
            if over and self._may_wait is not None:
                over = self._may_wait(bucket, 0.0)
            if not (all_of_them or work is None or over or work.is_completed()):
                break
            self._in_flight.pop(0)
            if work is not None:
                work.wait()
            self._finish_fn(bucket)

    def finish_done(self, patience: float) -> None:
        """Finish, oldest first, the buckets in flight that are done or may be waited for
        (`may_wait`, allowed `patience` seconds to decide): called before a zero3 root makes its
        gradients, so the ones reduced before it no longer take memory."""
        while self._in_flight:
            bucket, work = self._in_flight[0]
            if not (work is None or work.is_completed()
                    or self._may_wait is None or self._may_wait(bucket, patience)):
                break
            self._in_flight.pop(0)
            if work is not None:
                work.wait()
            self._finish_fn(bucket)

    @staticmethod
    def _adopt_grad(bucket: GradBucket, i: int) -> None:
        """Make parameter i's `.grad` the bucket's view, copying a freshly made gradient in (or
        making it the buffer: see [Note: a gradient reduced where autograd made it] in
        buckets.py)."""
        param = bucket.params[i]
        grad = param.grad
        if grad is not None and bucket.takes(grad):
            bucket.take(grad)
            return
        bucket.allocate()
        view = bucket.view(i)
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            param.grad = view

    def _launch(self, bucket: GradBucket) -> None:
        bucket.allocate()
        used = []
        for i, p in enumerate(bucket.params):
            if p.grad is None:  # See [Note: gradients that never arrived]
                bucket.view(i).zero_()
                used.append(False)
            else:
                self._adopt_grad(bucket, i)
                used.append(True)
        bucket.set_flags(tuple(used))
        signal = self._signal() if self._signal is not None else 0.0
        if isinstance(signal, torch.Tensor):  # a flag on the device: copied, never read here
            bucket.signal().copy_(signal)
        else:
            bucket.signal().fill_(signal)
        self._in_flight.append((bucket, self._launch_fn(bucket)))

    def _end_of_backward(self) -> None:
        if not self.pass_sync:  # accumulating: nothing was sent, nothing to end
            self._callback_queued = False
            return
        self.end_backward()

    def end_backward(self) -> None:
        """Launch what is left, wait for everything and hand on: the end of every backward
        that communicates, and of one that raised (see [Note: a backward that raised])."""
        # See [Note: one launch order on every rank]
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        self._finish_in_flight(all_of_them=True)
        order = self._ready_order
        self._reset_iteration()
        if order is not None:
            self._ready_order = None
            seen = {b.index for b in order}
            self._on_first_order(order + [b for b in self.buckets if b.index not in seen])
        if self._on_end is not None:
            self._on_end()


def _weak_hook(reducer: "GradReducer") -> Callable:
    ref = weakref.ref(reducer)

    def on_grad_ready(param: torch.Tensor) -> None:
        alive = ref()
        if alive is not None and not alive._disarmed:
            alive._on_grad_ready(param)

    return on_grad_ready
