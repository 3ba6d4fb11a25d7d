"""Completion on NCCL, where a work's future and a blocking call both return at enqueue: every
collective, blocking or not, stays in flight until its work says it has completed, and is
polled until then however many newer collectives follow it ([Note: completion on NCCL] in
completion.py, [Note: records in flight] in records.py).

There is no NCCL here: a Comm over a stand-in group whose backend reads "nccl" issues through
stand-ins of torch.distributed's calls that, like NCCL's, return at once, a work (when asked for
one) that completes only when the test says so, and nothing when the call is blocking. On gloo,
real ranks check that blocking collectives still complete at return, and that the NCCL way of
issuing them (async, then waited for) gives the same results.
"""

import types

import pytest
import torch
import torch.distributed as dist

from phalanx.comm import collectives, records
from phalanx.comm.collectives import Comm, Handle
from phalanx.faults import hangs
from phalanx.testing import run_ranks
from phalanx.world import runtime

FAKE = object()  # the stand-in NCCL group


class FakeWork:
    """An NCCL work: `wait()` only orders the current stream after it, so it completes when the
    test sets `done`, not when waited for."""

    def __init__(self, done: bool):
        self.done = done
        self.waits = 0
        self.queries = 0

    def is_completed(self) -> bool:
        self.queries += 1
        return self.done

    def wait(self) -> bool:
        self.waits += 1
        return True


class FakeEvent:
    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


@pytest.fixture
def nccl(monkeypatch):
    """A Comm over FAKE, as on NCCL: `.comm`, `.issued` (the works handed out, in order) and
    `.done_at_issue` (whether new works are already complete)."""
    state = types.SimpleNamespace(issued=[], done_at_issue=False)

    def issue(async_op):
        if not async_op:
            return None  # NCCL's blocking call: back at enqueue, nothing to poll
        work = FakeWork(state.done_at_issue)
        state.issued.append(work)
        return work

    def fills(outputs, tensor):
        for out in outputs or ():
            out.copy_(tensor)

    def our(real, value):
        return lambda group=None, *a, **k: value if group is FAKE else real(group, *a, **k)

    monkeypatch.setattr(dist, "get_world_size", our(dist.get_world_size, 2))
    monkeypatch.setattr(dist, "get_rank", our(dist.get_rank, 0))
    monkeypatch.setattr(dist, "get_backend", our(dist.get_backend, "nccl"))
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "all_reduce",
                        lambda tensor, op=None, group=None, async_op=False: issue(async_op))
    monkeypatch.setattr(dist, "broadcast",
                        lambda tensor, src=None, group=None, async_op=False: issue(async_op))
    monkeypatch.setattr(dist, "all_gather", lambda outputs, tensor, group=None, async_op=False:
                        fills(outputs, tensor) or issue(async_op))
    monkeypatch.setattr(dist, "gather", lambda tensor, outputs=None, dst=None, group=None,
                        async_op=False: fills(outputs, tensor) or issue(async_op))
    monkeypatch.setattr(dist, "barrier", lambda group=None, async_op=False, device_ids=None:
                        issue(async_op))
    monkeypatch.setattr(collectives, "CHECK_COLLECTIVES", False)
    # No CUDA here: the events around a wait, in the module that defines Handle.
    monkeypatch.setitem(Handle.wait.__globals__, "_device_interval",
                        lambda fn: (fn(), (FakeEvent(), FakeEvent()))[1])
    state.comm = Comm(FAKE, name="fake nccl", device=torch.device("cpu"))
    yield state
    state.comm.close()


BLOCKING = {
    "all_reduce": lambda comm: comm.all_reduce(torch.ones(4)),
    "broadcast": lambda comm: comm.broadcast(torch.ones(4), src=1),
    "all_gather_list": lambda comm: comm.all_gather_list(torch.ones(3)),
    "all_gather_object": lambda comm: comm.all_gather_object({"rank": 0}),
    "gather_object to this rank": lambda comm: comm.gather_object("x", dst=0),
    "gather_object to another": lambda comm: comm.gather_object("x", dst=1),
    "barrier": lambda comm: comm.barrier(),
}


@pytest.mark.one_process
@pytest.mark.parametrize("kind", list(BLOCKING))
def test_a_blocking_collective_on_nccl_is_in_flight_until_its_work_completes(nccl, kind):
    out = BLOCKING[kind](nccl.comm)
    rec = nccl.comm.records[-1]
    assert rec.completed is None, "stamped complete when the call came back (at enqueue)"
    work = nccl.issued[-1]
    if kind == "all_gather_list":
        assert [t.tolist() for t in out] == [[1.0] * 3] * 2
    elif kind == "all_gather_object":
        assert out == [{"rank": 0}] * 2
    elif kind == "gather_object to this rank":
        assert out == ["x", "x"]
    # issued async and waited for (the stream's wait), not stamped complete at the return
    assert work.waits == 1
    assert rec.pending == [work]
    assert rec.stall is not None  # the stall is timed on the device, as an async one's
    assert hangs._oldest_in_flight(records.records_on(FAKE)) is rec  # what the watcher sees
    records.poll_completions([rec])
    assert rec.completed is None
    work.done = True
    records.poll_completions([rec])
    assert rec.completed is not None and rec.completed >= rec.started and rec.pending == []
    assert hangs._oldest_in_flight(records.records_on(FAKE)) is None


@pytest.mark.one_process
def test_a_record_in_flight_behind_more_than_64_newer_ones_is_still_polled(nccl):
    """The watcher hands `poll_completions` only each group's newest 64 records; the oldest one
    in flight must still be polled at its tick, and stamped once its work completes."""
    old = nccl.comm.all_reduce(torch.ones(2), async_op=True, tag="old")
    old.wait()  # the stream waits; the device is not done yet
    stuck, rec = nccl.issued[-1], old.records[0]
    nccl.done_at_issue = True
    for _ in range(100):
        nccl.comm.all_reduce(torch.ones(2), tag="newer")
    newer = nccl.issued[-100:]
    assert all(r.completed is not None for r in list(nccl.comm.records)[1:])
    watcher = types.SimpleNamespace(world=2)  # all HangWatch._groups reads of its watcher
    recs = hangs.HangWatch._groups(watcher)["fake nccl"]
    assert hangs._oldest_in_flight(recs) is rec and rec.completed is None
    stuck.done = True
    queries = sum(w.queries for w in newer)
    recs = hangs.HangWatch._groups(watcher)["fake nccl"]
    assert rec.completed is not None and rec.pending == []
    assert hangs._oldest_in_flight(recs) is None
    # only what is in flight is polled: the completed records' works are not queried again
    assert sum(w.queries for w in newer) == queries
    assert nccl.comm.in_flight == []


def _blocking_on_gloo(polls: bool):
    comm = Comm(runtime.default_group())
    if polls:  # issue as on NCCL (async, then waited for), over gloo's real works
        comm.polls = True
        Handle.wait.__globals__["_device_interval"] = lambda fn: (fn(), (FakeEvent(),
                                                                        FakeEvent()))[1]
    rank = comm.rank
    out = {}
    t = torch.full((3,), float(rank + 1))
    comm.all_reduce(t, op="sum")
    out["all_reduce"] = t.tolist()
    t = torch.full((2,), float(rank))
    comm.broadcast(t, src=1)
    out["broadcast"] = t.tolist()
    out["all_gather_list"] = [p.tolist() for p in comm.all_gather_list(torch.tensor([rank]))]
    out["all_gather_object"] = comm.all_gather_object({"rank": rank})
    out["gather_object"] = comm.gather_object(rank * 10, dst=0)
    comm.barrier()
    if polls:
        records.poll_completions([])
    out["records"] = [(r.kind, r.completed is not None and r.completed >= r.started,
                       len(r.pending)) for r in comm.records]
    out["in_flight"] = len(getattr(comm, "in_flight", ()))
    return out


@pytest.mark.parametrize("polls", [False, True], ids=["gloo", "issued as on nccl"])
def test_blocking_collectives_on_gloo_complete_at_return(polls):
    for rank, out in enumerate(run_ranks(_blocking_on_gloo, 2, args=(polls,), timeout=60)):
        assert out["all_reduce"] == [3.0] * 3
        assert out["broadcast"] == [1.0] * 2
        assert out["all_gather_list"] == [[0], [1]]
        assert out["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert out["gather_object"] == ([0, 10] if rank == 0 else None)
        kinds = ["all_reduce", "broadcast", "all_gather", "all_gather_object", "gather_object",
                 "barrier"]
        # complete (at return on gloo; as on NCCL, once seen complete at a wait or poll)
        assert out["records"] == [(kind, True, 0) for kind in kinds]
        assert out["in_flight"] == 0
