"""The hang watcher's thread never stops silently: an error of its own is reported once and
watching goes on; only the loss of the store (the job is ending) stops it."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from phalanx.comm import records
from phalanx.comm.collectives import Comm
from phalanx.faults.hangs import HangWatch

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)


class Store:
    """A store whose `check` fails as told: a bug of the watcher's, or the store gone."""

    def __init__(self, error):
        self.error, self.calls = error, 0

    def add(self, key, n):
        return n

    def check(self, keys):
        self.calls += 1
        if self.calls <= 3:
            raise self.error
        return False


def test_an_error_of_its_own_is_reported_once_and_watching_goes_on(capfd):
    store = Store(ValueError("a bug"))
    watch = HangWatch(store, rank=0, world=2, threshold=60, poll=0.01)
    try:
        deadline = time.monotonic() + 60  # an event with a bound, not a clock: the fourth look
        while store.calls <= 3 and watch._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch._thread.is_alive()
        assert store.calls > 3  # it kept ticking after the errors
    finally:
        watch.stop()
    err = capfd.readouterr().err
    assert err.count("the hang watcher met an error and goes on watching: ValueError") == 1


def test_the_store_gone_stops_the_watcher():
    watch = HangWatch(Store(dist.DistNetworkError("connection closed")), rank=0, world=2,
                      threshold=60, poll=0.01)
    watch._thread.join(timeout=5)
    assert not watch._thread.is_alive()


def test_comms_made_while_the_watcher_reads_are_safe():
    """The watcher reads the live Comms from its thread while the training thread makes them
    (sync BatchNorm's first forward, a background save): iterating the set unlocked could
    raise "set changed size during iteration" and end the watching."""
    stop, errors = threading.Event(), []

    def read():
        while not stop.is_set():
            try:
                records.groups_in_use()
                records.live()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(20000):
            Comm(None)
    finally:
        stop.set()
        reader.join()
    assert not errors, errors[:1]


def test_a_store_that_does_not_answer_is_given_up_on_and_taken_back():
    """[Note: a store that does not answer] in src/phalanx/faults/store_calls.py: a look at a
    store whose server is frozen raises StoreSilent after the patience, the next one says how
    long it has been silent, and once the store answers again so do the looks."""
    from phalanx.faults.store_calls import BoundedStore, StoreSilent

    thawed = threading.Event()

    class Frozen:
        def check(self, keys):
            thawed.wait()
            return True

    store = BoundedStore(Frozen(), patience=0.05)
    with pytest.raises(StoreSilent) as first:
        store.check(["flag"])
    with pytest.raises(StoreSilent) as second:
        store.check(["flag"])
    assert second.value.seconds > first.value.seconds >= 0.05
    thawed.set()
    store.patience = 60  # bounded by the thaw, not by a clock
    assert store.check(["flag"]) is True
