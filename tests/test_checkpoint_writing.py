"""How a save is written: a save killed midway (on one rank or all) leaves the previous
checkpoint as the latest, keep_last keeps the newest, and a background save holds the state of
the call while training goes on, its failure raised at the next call on every rank.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from checkpoint_runs import K, make_model, make_optimizer, state_of, train_steps

import phalanx as px
from phalanx.testing import RanksFailed, run_ranks


# -- crash safety, keep_last, latest_checkpoint -------------------------------------------------
def _save_then_die(path, where):
    """Save `step=2` over the directory of checkpoints, and SIGKILL this process at `where`."""
    import phalanx.checkpoint.saving as api

    model = make_model(0)
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2")
    px.save(os.path.join(path, "step1"), model=model, optimizer=opt, step=1)
    kill = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if where == "rank file":
        api.write_tensors = kill
    elif where == "manifest":
        api.json.dump = kill
    elif where == "rename":
        api.fsync_dir = kill
    px.save(os.path.join(path, "step2"), model=model, optimizer=opt, step=2)
    return True


def _save_then_one_rank_dies(path):
    """Rank 1 is SIGKILLed while it writes its file of the second save; rank 0 goes on."""
    import phalanx.checkpoint.saving as saving

    model = make_model(0)
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2")
    px.save(os.path.join(path, "step1"), model=model, optimizer=opt, step=1)
    if px.rank() == 1:
        saving.write_tensors = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    px.save(os.path.join(path, "step2"), model=model, optimizer=opt, step=2)
    return True


def test_one_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_save_then_one_rank_dies, 2, args=(str(tmp_path),), timeout=60)
    assert "rank 1" in str(failed.value)
    assert px.latest_checkpoint(tmp_path) == str(tmp_path / "step1")
    assert px.load(tmp_path / "step1", model=make_model(3)) == {"step": 1}
    # rank 0 saw its peer gone in the save and removed what the save began: a job that ends
    # here leaves no half-written save behind
    assert sorted(os.listdir(tmp_path)) == ["step1"], os.listdir(tmp_path)


@pytest.mark.parametrize("where", ["rank file", "manifest", "rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, where):
    with pytest.raises(RanksFailed):
        run_ranks(_save_then_die, 2, args=(str(tmp_path), where), timeout=60)
    latest = px.latest_checkpoint(tmp_path)
    assert latest == str(tmp_path / "step1")
    model = make_model(3)
    assert px.load(latest, model=model) == {"step": 1}
    # the next complete save with keep_last removes what the killed one left
    assert any(".partial-" in entry for entry in os.listdir(tmp_path))
    px.save(tmp_path / "step3", model=model, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step1", "step3"]


@pytest.mark.one_process
def test_keep_last_keeps_the_newest(tmp_path):
    model = make_model(0)
    for step in range(4):
        px.save(tmp_path / f"step{step}", model=model, keep_last=2, step=step)
    assert sorted(os.listdir(tmp_path)) == ["step2", "step3"]
    assert px.latest_checkpoint(tmp_path) == str(tmp_path / "step3")
    assert px.latest_checkpoint(tmp_path / "step3" / "nothing-here") is None


# -- saving in the background ---------------------------------------------------------------
def _save_in_background_then_train(path, sync_path):
    torch.manual_seed(0)
    model = make_model(0)
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2")
    train_steps(model, opt, K, 0, px.world_size(), px.rank())
    px.save(sync_path, model=model, optimizer=opt, step=K)
    import phalanx.checkpoint.saving as saving

    write, trained = saving.write_tensors, threading.Event()

    def late_write(*args):  # the write starts after the training below has changed everything
        assert trained.wait(timeout=120), "the training did not end while the save waited"
        return write(*args)

    saving.write_tensors = late_write
    px.save(path, model=model, optimizer=opt, background=True, step=K)
    train_steps(model, opt, K, K, px.world_size(), px.rank())  # changes what was being saved
    trained.set()
    px.shutdown()  # waits for the save
    return True


def _load_both(path, sync_path):
    states = []
    for where in (path, sync_path):
        model = make_model(50)
        opt = make_optimizer(model)
        model, opt = px.prepare(model, opt, strategy="ddp")
        assert px.load(where, model=model, optimizer=opt) == {"step": K}
        states.append(state_of(model, opt))
    return states


def test_a_background_save_holds_the_state_of_the_call_while_training_goes_on(tmp_path):
    path, sync_path = str(tmp_path / "background"), str(tmp_path / "sync")
    run_ranks(_save_in_background_then_train, 2, args=(path, sync_path))
    for (bg_params, bg_optim), (params, optim) in run_ranks(_load_both, 3,
                                                            args=(path, sync_path)):
        assert all(torch.equal(bg_params[k], params[k]) for k in params)
        assert all(torch.equal(bg_optim[n][k], optim[n][k]) for n in optim for k in optim[n])


def _two_background_saves(paths):
    """A background save, K more steps, another: the second copies into the first's memory
    (checkpoint/saving.py keeps it), and each holds the state of its own call."""
    from phalanx.world.process import state

    torch.manual_seed(0)
    model = make_model(0)
    model, opt = px.prepare(model, make_optimizer(model), strategy="zero2")
    kept = []
    for i, (background, sync) in enumerate(paths):
        train_steps(model, opt, K, i * K, px.world_size(), px.rank())
        px.save(sync, model=model, optimizer=opt, step=K)
        px.save(background, model=model, optimizer=opt, background=True, step=K)
        kept.append({k: v.data_ptr() for k, v in state.staged.items()})
    px.shutdown()
    return kept


def test_a_second_background_save_reuses_the_first_ones_memory_and_holds_its_own_state(
        tmp_path):
    paths = [(str(tmp_path / f"background{i}"), str(tmp_path / f"sync{i}")) for i in range(2)]
    for first, second in run_ranks(_two_background_saves, 2, args=(paths,)):
        assert first and first == second  # the same tensors, at the same addresses
    for background, sync in paths:
        for (bg_params, bg_optim), (params, optim) in run_ranks(_load_both, 2,
                                                                args=(background, sync)):
            assert all(torch.equal(bg_params[k], params[k]) for k in params)
            assert all(torch.equal(bg_optim[n][k], optim[n][k])
                       for n in optim for k in optim[n])


def _background_save_fails(path):
    model = make_model(0)
    model, _ = px.prepare(model, None, strategy="ddp")
    px.save(path, model=model, background=True)  # returns: the failure comes later
    try:
        px.save(path + "-next", model=model)
    except px.CheckpointError as exc:
        return str(exc)
    return "no error"


def test_a_background_save_that_fails_raises_at_the_next_call_on_every_rank(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    messages = run_ranks(_background_save_fails, 2, args=(str(blocker / "ckpt"),))
    for message in messages:
        assert "writing the ranks' files failed" in message
        assert "rank 0: NotADirectoryError" in message and "rank 1: NotADirectoryError" in message
