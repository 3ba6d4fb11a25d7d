"""The hang watcher's thread never stops silently: an error of its own is reported once and
watching goes on; only the loss of the store (the job is ending) stops it."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from phalanx import records
from phalanx.collectives import Comm
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
    watch = HangWatch(Store(ValueError("a bug")), rank=0, world=2, threshold=60, poll=0.01)
    try:
        time.sleep(0.3)
        assert watch._thread.is_alive()
        assert watch.store.calls > 3  # it kept ticking after the errors
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
