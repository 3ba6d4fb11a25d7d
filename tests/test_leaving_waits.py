"""A rank's end never waits in silence (src/phalanx/world/leaving.py's [Note: a rank's end]).

The wait at the end is for the count every rank adds to, not for a key one rank writes for all
after its add; and past the hang threshold it says what it waits for, naming the ranks, before
the job's timeout ends it. Here in one process, over a store the test holds: the peer, rank
1, never comes."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from phalanx.world import leaving
from phalanx.world.process import state

pytestmark = pytest.mark.one_process


def test_a_wait_at_the_end_names_who_it_waits_for_then_leaves_without_them(capfd):
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    now = state.leaving
    try:
        now.__init__(store=store, rank=0, world=2, timeout=0.5, end=None, prefix="t",
                     said_after=0.05)
        leaving.leave("px.shutdown")
        err = capfd.readouterr().err
        assert ("phalanx: rank 0 has waited 0 s at its end for rank 1 to reach its own end "
                "(px.shutdown(), destroy_process_group() or the end of the script), answering "
                "for its shards meanwhile; it waits up to px.init(timeout=0)") in err, err
        assert err.count("has waited") == 1, err  # said once
        assert "rank 1 has not reached its own end" in err, err  # then the timeout's word
    finally:
        now.__init__()


def test_the_count_alone_ends_the_wait():
    """Rank 1 counts itself in after rank 0 has begun to wait, and writes nothing for the
    others: rank 0's wait ends. (Before, the rank whose add completed the count then wrote an
    `all` key that the others waited for; one that stalled or raised between the two kept
    every peer waiting for the job's timeout, silently.)"""
    import threading
    import time

    store = dist.HashStore()
    now = state.leaving
    try:
        now.__init__(store=store, rank=0, world=2, timeout=120.0, end=None, prefix="t",
                     said_after=60.0)
        waiting = threading.Thread(target=leaving.leave, args=("px.shutdown",), daemon=True)
        waiting.start()
        while store.add("t/count", 0) < 1:  # rank 0 has counted itself in and waits
            time.sleep(0.01)
        store.set("t/1", "px.shutdown")
        store.add("t/count", 1)
        waiting.join(timeout=60)  # bounded far below the wait's own 120 s
        assert not waiting.is_alive(), "rank 0 still waits with every rank counted in"
    finally:
        now.__init__()
