"""`phalanx run --on-failure continue`, piece by piece in one process: the recovery decision on
reports made up here, the sampler's redo and replay, the members' keys in a store made here,
and a collective lost halfway. The jobs themselves are in tests/test_keep_going.py."""

from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.continuing.membership import MembershipError
from phalanx.continuing.steps import decide

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)


# -- the decision, on reports made up here --------------------------------------------------
def _report(calls, last_voted, phase1=False):
    return {"calls": calls, "last_voted": last_voted, "phase1": phase1, "cause": ""}


def test_the_decision_commits_a_step_whose_vote_completed_anywhere():
    # rank 0 saw step 5's vote complete and failed in step 6; rank 2 failed inside the vote
    # of step 5: step 5 commits everywhere, both drop step 6, the one behind drops it unused
    d = decide(0, {0: (0, _report(6, 5)), 2: (0, _report(5, 4, phase1=True))},
               {1: {"exitcode": -9}})
    assert (d.committed, d.resume_after, d.survivors, d.skip) == (5, 6, [(0, 0), (2, 0)], False)
    # nobody saw step 5's vote complete: step 4 is the last, step 5 is redone
    d = decide(0, {0: (0, _report(5, 4, phase1=True)), 2: (0, _report(5, 4))},
               {1: {"exitcode": -9}})
    assert (d.committed, d.resume_after) == (4, 5)
    d = decide(0, {0: (0, _report(5, 4))}, {1: {"exitcode": 1, "raised": {"message": "x"}}})
    assert d.skip


def test_the_decision_refuses_reports_that_cannot_happen():
    with pytest.raises(MembershipError, match="disagree on the last step"):
        decide(0, {0: (0, _report(6, 5)), 2: (0, _report(4, 3))}, {1: {"exitcode": -9}})
    with pytest.raises(MembershipError, match="no member left"):
        decide(0, {0: (0, _report(3, 2))}, {})


def test_a_step_redone_after_a_load_at_the_end_of_an_epoch_begins_the_next_epoch():
    """A checkpoint saved after an epoch's last step holds the position at its end; a step
    lost right after loading it (a replacement admitted there) is the next epoch's first, and
    the redo must not go back to the finished epoch (that skipped a whole epoch once)."""
    sampler = px.DistributedSampler(list(range(24)), batch_size=4, rank=0, world_size=1)
    passes = list(sampler.batches())
    sampler._steps_done = len(passes)  # the loop received every batch of epoch 0
    state = sampler.state_dict()
    assert (state["epoch"], state["consumed"]) == (0, 24)
    sampler.load_state_dict(state)
    sampler.set_epoch(1)
    first = next(iter(sampler.batches()))
    sampler.replay.resume_after_loss(skip=False)
    assert (sampler.epoch, sampler._start) == (1, 0)
    assert next(iter(sampler.batches())) == first


def test_a_replay_from_an_older_checkpoint_leaves_out_the_skipped_batch_where_it_fell():
    """A sharded engine goes back to its checkpoint (step 1 here) after a rank raised in
    step 3: steps 1 and 2 are trained again and step 3's batch is left out when the replay
    reaches it; the position saved after the replay counts the batch left out."""
    sampler = px.DistributedSampler(list(range(24)), batch_size=4, rank=0, world_size=1,
                                    shuffle=False)
    batches = iter(sampler.batches())
    for _ in range(3):
        next(batches)
        sampler._batch_consumed()
    checkpoint = {"epoch": 0, "consumed": 4}  # saved after step 0
    sampler.replay.commit_step()                  # step 2 committed everywhere: position 12
    next(batches)
    sampler._batch_consumed()                 # step 3, lost: a rank raised
    sampler.replay.rewind_to(checkpoint)
    sampler.replay.resume_after_loss(skip=True)
    replay = list(sampler.batches())
    assert replay == [[4, 5, 6, 7], [8, 9, 10, 11], [16, 17, 18, 19], [20, 21, 22, 23]]
    assert sampler.batches_left() == 4 and sampler.samples_left() == 16
    assert len(sampler) == 24  # the whole epoch's, as for PyTorch's sampler
    sampler._steps_done = 2
    assert sampler.state_dict()["consumed"] == 16
    sampler._steps_done = 4
    sampler._pass_finished()
    assert (sampler.epoch, sampler.position()) == (1, 0) and list(sampler.batches())[2] == \
        [8, 9, 10, 11]  # the next epoch is whole


# -- the members' keys, in a store made here ---------------------------------------------------
def _membership(me, life, world=3):
    import datetime

    from phalanx.continuing.membership import Membership

    return Membership(torch.distributed.HashStore(), me, world, life, "gloo",
                      datetime.timedelta(seconds=30), torch.device("cpu"))


@pytest.mark.parametrize("last_end,completed", [("left", False), ("done", True)])
def test_a_replacement_nobody_can_admit_ends_as_the_job_did(last_end, completed):
    """Every member of the last generation gone before admitting rank 1's replacement: it ends
    well if one of them finished its training, else with an error, so that a job whose every
    worker failed does not end as completed (it once did, with every worker dead)."""
    from phalanx.continuing import joining, store as keys

    m = _membership(1, 1)
    keys.write(m.store, "gen", 1)
    keys.write(m.store, "gen1/members", [(0, 0), (2, 0)])
    keys.write(m.store, "left/0.0", {"exitcode": -9, "time": 0.0})
    if last_end == "left":
        keys.write(m.store, "left/2.0", {"exitcode": 1, "time": 0.0})
    else:
        keys.write(m.store, "done/2.0", True)
    with pytest.raises(SystemExit) as ended:
        joining.wait_for_admission(m)
    if completed:
        assert ended.value.code == 0
    else:
        assert "every member of the job failed before admitting it" in str(ended.value.code)


def test_a_request_to_report_is_forgotten_when_the_next_generation_forms(tmp_path):
    """A member asked to report in generation g (its wait gave up there) must not give up the
    waits of generation g+1: it once lost the step again at the first collective of the new
    group, and every survivor ended on 'no member left the job'."""
    from phalanx.comm.collectives import Comm
    from phalanx.comm.gate import gate

    m = _membership(0, 0, world=1)
    gate.active, gate.poked = True, True
    try:
        assert m.form(1, [(0, 0)])
        total = torch.ones(2)
        Comm(torch.distributed.group.WORLD, name="world").all_reduce(total, op="sum")
        assert not gate.cut and total.tolist() == [1.0, 1.0]
    finally:
        gate.active = gate.cut = gate.poked = False
        torch.distributed.destroy_process_group()


def test_an_object_gather_lost_halfway_gives_this_ranks_own_value_not_garbage(monkeypatch):
    """The lengths' all-gather fails (a peer died): the pickles' all-gather after it must not
    read buffers nothing filled; the gather returns what a collective that moved nothing
    would. It once loaded unfilled bytes (UnpicklingError) and ended a survivor."""
    import datetime

    from phalanx.comm import collectives
    from phalanx.comm.gate import gate

    class Broken:
        def wait(self, timeout=None):
            raise RuntimeError("Connection reset by peer")

        def get_future(self):
            raise RuntimeError("no future")

    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1,
                                         timeout=datetime.timedelta(seconds=30))
    comm = collectives.Comm(torch.distributed.group.WORLD, name="world")
    monkeypatch.setattr(collectives.dist, "all_gather", lambda *a, **k: Broken())
    gate.active = True
    try:
        assert comm.all_gather_object({"mine": 7}, tag="t") == [{"mine": 7}]
        assert gate.cut
    finally:
        gate.active = gate.cut = False
        torch.distributed.destroy_process_group()


def test_a_sampler_loaded_during_a_replay_leaves_out_what_the_replay_will():
    """A replacement admitted at a save taken during a replay (a sharded engine back at an
    older checkpoint after a rank raised) loads the sampler's state: the batch left out
    further on must be left out by it too, or it trains one step more than the others."""
    def sampler():
        return px.DistributedSampler(list(range(24)), batch_size=4, rank=0, world_size=1,
                                     shuffle=False)

    replaying = sampler()
    batches = iter(replaying.batches())
    for _ in range(4):
        next(batches)
        replaying._batch_consumed()
    replaying.replay.commit_step()                # steps 0-3 committed: position 16
    next(batches)
    replaying._batch_consumed()               # step 4, lost: a rank raised
    replaying.replay.rewind_to({"epoch": 0, "consumed": 4})
    replaying.replay.resume_after_loss(skip=True)
    batches = iter(replaying.batches())
    next(batches)
    replaying._batch_consumed()               # step 1 replayed; a save now: position 8
    joined = sampler()
    joined.load_state_dict(replaying.state_dict())
    rest = [[8, 9, 10, 11], [12, 13, 14, 15], [20, 21, 22, 23]]
    assert list(joined.batches()) == rest and list(batches) == rest
    assert joined.batches_left() == 3 and len(joined) == 24


# -- a replay into a finished epoch, and the ledger that checks every replay -------------------
def _with_ledger(sampler):
    """A sampler as continue mode makes it (with a ledger), in a process without a job."""
    from phalanx.data.ledger import Ledger

    sampler.replay.ledger = Ledger()
    return sampler


def _step(*samplers, commits=True):
    """`optimizer.step()` as the step gate sees it: called, and committed unless lost."""
    from phalanx.data.ledger import step_called

    step_called([sampler.replay for sampler in samplers])
    if commits:
        for sampler in samplers:
            sampler.replay.commit_step()


def test_a_replay_back_into_the_epoch_the_loop_finished_goes_on_through_the_loops_epoch():
    """The issue's case in one process: a checkpoint saved before the last step of epoch 0, a
    rank lost in the save after that step, and the loss seen in the first step of epoch 1 (the
    loop's set_epoch(1) and `for` already begun). A sharded engine goes back to the checkpoint:
    the loader's iteration serves the rest of epoch 0, then the whole of epoch 1 (it once
    ended after epoch 0's last batch, and epoch 1 was lost)."""
    loader = px.data_loader(list(range(24)), 4, shuffle=False)
    sampler = _with_ledger(loader.sampler)
    loader.sampler.set_epoch(0)
    for i, _batch in enumerate(loader):
        _step(sampler)
        if i == 4:
            checkpoint = sampler.state_dict()  # px.save after step 4: position 20
    loader.sampler.set_epoch(1)
    served = []
    for batch in loader:
        served.append(batch.tolist())
        if len(served) == 1:  # step 6 (epoch 1's first) is where the loss is seen: thrown away
            _step(sampler, commits=False)
            sampler.replay.rewind_to(checkpoint)
            sampler.replay.resume_after_loss(skip=False)
            assert loader.batches_left() == 1 + 6  # the rest of epoch 0, then all of epoch 1
        else:
            _step(sampler)
    epoch1 = [[i, i + 1, i + 2, i + 3] for i in range(0, 24, 4)]
    assert served == [epoch1[0], [20, 21, 22, 23]] + epoch1
    assert (sampler.epoch, sampler.position()) == (2, 0)
    assert sampler.replay.ledger.mismatches() == []
    assert sampler.replay.ledger.done == {0: [24, 6], 1: [24, 6]}


def test_the_ledger_makes_a_lost_batch_an_error_and_a_replay_balances_it():
    """One mechanism for every way a recovery could lose data: the loop's batches each count
    once (the first time it steps after one), the model's go back with it; a step thrown away
    and never served again is an error naming the epoch and both counts."""
    from phalanx.continuing.steps import StepBoundary

    train = _with_ledger(px.DistributedSampler(list(range(24)), batch_size=4, rank=0,
                                               world_size=1, shuffle=False))
    evaluation = _with_ledger(px.DistributedSampler(list(range(8)), batch_size=4, rank=0,
                                                    world_size=1, shuffle=False))
    batches = iter(train.batches())
    for _ in range(3):
        next(batches)
        train._batch_consumed()
        _step(train, evaluation)
        for _ in evaluation.batches():  # an evaluation between steps: in no step's count
            evaluation._batch_consumed()
    next(batches)
    train._batch_consumed()
    _step(train, evaluation, commits=False)   # step 3, lost with a rank
    train.replay.resume_after_loss(skip=False)
    evaluation.replay.resume_after_loss(skip=False)
    gate = StepBoundary(None)
    with pytest.raises(MembershipError, match="at the end of the job, the model does not hold "
                       "what the loop was served after a recovery from a lost rank: epoch 0: "
                       "the loop took 16 samples in 4 optimizer steps, the model holds 12 "
                       "samples in 3 optimizer steps"):
        gate.check_ledgers([train.replay, evaluation.replay], "at the end of the job")
    replay = iter(train.batches())           # the replay serves step 3's batch again
    assert next(replay) == [12, 13, 14, 15]
    train._batch_consumed()
    _step(train, evaluation)
    gate.check_ledgers([train.replay, evaluation.replay], "at the end of the job")
    assert evaluation.replay.ledger.due == evaluation.replay.ledger.done == {}
    next(replay)                             # step 4, lost after a rank raised: left out
    train._batch_consumed()
    _step(train, evaluation, commits=False)
    train.replay.resume_after_loss(skip=True)
    gate.check_ledgers([train.replay], "at the end of the job")
    assert train.replay.ledger.done == {0: [16, 4]}
    assert list(train.batches()) == [[20, 21, 22, 23]]
    state = train.state_dict()               # what a px.save keeps, and a load starts from
    assert state["ledger"] == [[0, 16, 4]]
    loaded = _with_ledger(px.DistributedSampler(list(range(24)), batch_size=4, rank=0,
                                                world_size=1, shuffle=False))
    loaded.load_state_dict(state)
    assert loaded.replay.ledger.due == loaded.replay.ledger.done == {0: [16, 4]}
    loaded.set_epoch(1)                      # a pass begun in epoch 0 that ends in epoch 1
    loaded.replay.loop_pass_ends(0)
    with pytest.raises(MembershipError, match="a pass the loop began in epoch 0 ended in "
                       "epoch 1"):
        gate.check_ledgers([loaded.replay], "at the end of a pass over the data")


@pytest.mark.parametrize("how", ["plain DataLoader", "sampler left out of px.save"])
def test_a_batch_not_served_again_after_a_loss_fails_the_ledger(how):
    """A torch DataLoader over the sampler goes on with its own iterator after a loss (only
    px.data_loader begins its iteration again); a sharded engine goes back to a checkpoint
    that does not hold the sampler, which stays where it was. Either way a batch the model
    lost is not trained again, and the ledger says which epoch and how much."""
    from phalanx.continuing.steps import StepBoundary

    sampler = _with_ledger(px.DistributedSampler(list(range(24)), batch_size=4, rank=0,
                                                 world_size=1, shuffle=False))
    gate = StepBoundary(None)
    gate.samplers.add(sampler.replay)
    if how == "plain DataLoader":
        loader = torch.utils.data.DataLoader(list(range(24)), batch_size=4, sampler=sampler)
        for i, _ in enumerate(loader):
            _step(sampler, commits=i != 2)    # step 2 lost with a rank
            if i == 2:
                sampler.replay.resume_after_loss(skip=False)
        lost = "the loop took 24 samples in 6 optimizer steps, the model holds 20 samples in 5"
    else:
        batches = iter(sampler.batches())
        for i in range(4):
            next(batches)
            sampler._batch_consumed()
            _step(sampler)
            if i == 1:                        # saved after step 1, without the sampler
                gate.saved("checkpoint", None, None, {})
        gate.ledgers_back_to("checkpoint", {})  # a loss: the model goes back to step 1's
        sampler.replay.resume_after_loss(skip=False)
        lost = "the loop took 16 samples in 4 optimizer steps, the model holds 8 samples in 2"
    with pytest.raises(MembershipError, match=f"epoch 0: {lost}"):
        gate.check_ledgers([sampler.replay], "at the end of the job")


@pytest.mark.parametrize("skip", [True, False], ids=["skipped", "redone"])
def test_a_recovery_at_an_epochs_last_step_does_not_start_the_next_epoch_inside_its_pass(skip):
    """The last step of epoch 0 lost, and the survivors resuming inside that pass: after a
    rank raised (its batch left out), or after a member that saw the step's vote complete
    committed it late (nothing to redo). The place after that step is epoch 1's start, and
    the pass must end there: it once served all of epoch 1 inside epoch 0's pass, and epoch 1
    again after the loop's set_epoch(1)."""
    loader = px.data_loader(list(range(24)), 4, shuffle=False)
    sampler = _with_ledger(loader.sampler)
    served = {0: [], 1: []}
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            served[epoch].append(batch.tolist())
            last = epoch == 0 and len(served[0]) == 6
            _step(sampler, commits=not (last and skip))
            if last:
                sampler.replay.resume_after_loss(skip=skip)
    epoch1 = [[i, i + 1, i + 2, i + 3] for i in range(0, 24, 4)]
    assert served == {0: [[i, i + 1, i + 2, i + 3] for i in range(0, 24, 4)], 1: epoch1}
    assert sampler.replay.ledger.mismatches() == []
    assert sampler.replay.ledger.done == {0: [20 if skip else 24, 5 if skip else 6], 1: [24, 6]}


# -- continue mode as one object ----------------------------------------------------------------
def test_every_call_the_floors_below_make_is_answered_by_the_session_and_off_by_the_plain_thing():
    """comm/continuation.py's `Continuation` declares the calls the engine, the model, the data
    and checkpoints make of continue mode, each as it runs with continue mode off; the
    `Session` px.init makes under continue mode answers every one of them (a call it did not
    answer would silently run as if continue mode were off)."""
    import inspect

    from phalanx.comm import continuation
    from phalanx.continuing.session import Session

    calls = [name for name, fn in vars(continuation.Continuation).items()
             if inspect.isfunction(fn) and not name.startswith("_")]
    assert len(calls) >= 19 and [c for c in calls if c not in vars(Session)] == []
    off = continuation.now()  # no px.init here: off
    assert type(off) is continuation.Continuation and not continuation.continuing()
    sampler = px.DistributedSampler(list(range(8)), batch_size=2, rank=0, world_size=1)
    assert sampler.replay.ledger is None  # not driven by a step boundary: no ledger
    assert off.gather_for_metrics(sampler.replay, lambda: "gathered", lambda: "empty",
                                  None) == "gathered"
    assert off.before_step(None) and not off.joining() and off.joiners_asking(None) == []
    assert off.generation() is None and off.member_gone() is None and off.models() == []
    with pytest.raises(RuntimeError, match="only a replacement"):
        off.wait_for_admission()
