"""Store calls that give up: the hang watcher asks the job's store through these.

[Note: a store that does not answer]
torch's TCPStore client waits for its server's answer with no bound: a `check`, `get`, `add`
or even a `wait` with a timeout, made to a store whose serving process is frozen (stopped by
SIGSTOP, or a machine that stopped answering), blocks for ever (measured on torch 2.13: still
blocked after 10 s with a client timeout of 3 s; only `set`, which needs no answer, returns).
Under `phalanx run --on-failure restart` or `stop` the store is served by rank 0's worker
(launch/rendezvous.py), so a frozen rank 0 froze every peer's hang watcher inside its first
look at the store, and nobody ever named the hang.

So the watcher's calls run on a thread of their own, and the watcher waits for each at most
`patience` seconds: a call that has not returned by then raises `StoreSilent`, saying for how
long the store has been silent, and the watcher goes on without it (and, once a collective has
waited past the threshold, reports alone: faults/hangs.py). One call is in flight at a time: a
later call first waits for the one still pending, so a thread stuck on a frozen store is one
thread, not one per tick. It is a daemon thread, so a process that ends does not wait for it.
"""

from __future__ import annotations

import queue
import threading
import time

__all__ = ["BoundedStore", "StoreSilent"]


class StoreSilent(Exception):
    """The store did not answer a call within the patience; `seconds`: since when it has not."""

    def __init__(self, seconds: float):
        super().__init__(f"the job's store has not answered for {seconds:.1f} s")
        self.seconds = seconds


class BoundedStore:
    """The calls of `store` the watcher makes, each bounded by `patience` seconds."""

    def __init__(self, store, patience: float):
        self.store, self.patience = store, patience
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = None  # (result box, done event, when it was asked) of the call in flight
        threading.Thread(target=self._serve, name="phalanx-hang-store", daemon=True).start()

    def close(self) -> None:
        """End the thread once it is free (a thread stuck on a frozen store stays, a daemon):
        it holds the store, whose server a rank 0 may host, and a next px.init makes another."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            done.set()

    def call(self, fn):
        """`fn()` (which calls the store) on the store's thread; its result, its exception, or
        `StoreSilent` if it has not returned within the patience."""
        if self._pending is not None:  # the last call has not returned: wait for it first
            _, done, since = self._pending
            if not done.wait(self.patience):
                raise StoreSilent(time.monotonic() - since)
        box, done, since = [], threading.Event(), time.monotonic()
        self._pending = (box, done, since)
        self._jobs.put((fn, box, done))
        if not done.wait(self.patience):
            raise StoreSilent(time.monotonic() - since)
        self._pending = None
        ok, value = box[0]
        if ok:
            return value
        raise value

    def check(self, keys):
        return self.call(lambda: self.store.check(keys))

    def get(self, key):
        return self.call(lambda: self.store.get(key))

    def set(self, key, value):
        return self.call(lambda: self.store.set(key, value))

    def add(self, key, amount):
        return self.call(lambda: self.store.add(key, amount))
