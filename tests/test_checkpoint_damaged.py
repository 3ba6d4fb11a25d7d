"""A damaged newest checkpoint: `px.latest_checkpoint` takes the newest one that verifies,
rank 0 says which it skipped and why, and the resumed run equals the run resumed from that
one (2 ranks, float64); `px.load` of the damaged one named explicitly stays an error."""

from __future__ import annotations

import os
import re
import shutil
import warnings

import pytest
import torch
from checkpoint_runs import K, make_model, make_optimizer, state_of, train_steps

import phalanx as px
from phalanx.testing import run_ranks

STRATEGY = "zero2"


def _prepared(seed):
    model = make_model(seed)
    opt = make_optimizer(model)
    return px.prepare(model, opt, strategy=STRATEGY)


def _train_saving_every_step(directory):
    model, opt = _prepared(0)
    for step in range(K):
        train_steps(model, opt, 1, step, px.world_size(), px.rank())
        px.save(os.path.join(directory, f"step{step}"), model=model, optimizer=opt, step=step)


def _resume(directories, explicit):
    """From each directory: the script's resume lines, then the steps left. From `explicit`:
    px.load of that checkpoint (an error is returned, not raised)."""
    out = {}
    for name, directory in directories.items():
        model, opt = _prepared(99)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt = px.latest_checkpoint(directory)
        step = px.load(ckpt, model=model, optimizer=opt)["step"] + 1
        train_steps(model, opt, 2 * K - step, step, px.world_size(), px.rank())
        out[name] = (os.path.basename(ckpt), [str(w.message) for w in caught],
                     state_of(model, opt))
    try:
        px.load(explicit, model=_prepared(99)[0])
        out["explicit"] = None
    except px.CheckpointError as exc:
        out["explicit"] = str(exc)
    return out


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {
    "truncated": ("rank00001.safetensors", _truncate, "has .* bytes, the manifest says"),
    "corrupted": ("rank00000.safetensors", _flip_a_byte, "does not match its checksum"),
}


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(tmp_path):
    saved = str(tmp_path / "saved")
    run_ranks(_train_saving_every_step, 2, args=(saved,), timeout=120)
    directories = {}
    for name, (file, damage, _) in DAMAGE.items():
        directories[name] = str(tmp_path / name)
        shutil.copytree(saved, directories[name])
        damage(os.path.join(directories[name], f"step{K - 1}", file))
    directories["reference"] = str(tmp_path / "reference")  # the step before, alone
    os.makedirs(directories["reference"])
    shutil.copytree(os.path.join(saved, f"step{K - 2}"),
                    os.path.join(directories["reference"], f"step{K - 2}"))
    explicit = os.path.join(directories["corrupted"], f"step{K - 1}")
    ranks = run_ranks(_resume, 2, args=(directories, explicit), timeout=180)

    for rank, results in enumerate(ranks):
        reference = results["reference"][2]
        for name, (file, _, why) in DAMAGE.items():
            ckpt, warned, state = results[name]
            assert ckpt == f"step{K - 2}", (name, ckpt)
            if rank == 0:  # rank 0 says which it skipped, and why
                assert len(warned) == 1, warned
                assert "skipped 1 damaged checkpoint and returns " in warned[0]
                assert f"{name}/step{K - 1}" in warned[0] and file in warned[0], warned
                assert re.search(why, warned[0]), warned
            else:
                assert warned == []
            for part, ref in zip(state, reference):  # the run resumed from the one before
                for key in ref:
                    value, want = part[key], ref[key]
                    if isinstance(want, dict):
                        assert all(torch.equal(value[k], want[k]) for k in want), (name, key)
                    else:
                        assert torch.equal(value, want), (name, key)
        assert "does not match its checksum" in results["explicit"]  # still an error


@pytest.mark.one_process
def test_a_directory_where_no_checkpoint_verifies_is_an_error_not_a_fresh_start(tmp_path):
    model = torch.nn.Linear(3, 2)
    for step in range(2):
        px.save(tmp_path / f"step{step}", model=model, step=step)
        _truncate(str(tmp_path / f"step{step}" / "rank00000.safetensors"))
    os.makedirs(tmp_path / "notes")  # not a checkpoint: no manifest, never named
    with pytest.raises(px.CheckpointError, match=r"no checkpoint there verifies .*step1: .*step0"):
        px.latest_checkpoint(tmp_path)
    assert px.latest_checkpoint(tmp_path / "notes") is None  # no checkpoint at all: None


@pytest.mark.one_process
def test_an_unreadable_newer_manifest_is_named_and_an_intact_directory_warns_nothing(tmp_path):
    model = torch.nn.Linear(3, 2)
    for step in range(2):
        px.save(tmp_path / f"step{step}", model=model, step=step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert px.latest_checkpoint(tmp_path) == str(tmp_path / "step1")
    _truncate(str(tmp_path / "step1" / "manifest.json"))
    with pytest.warns(UserWarning, match=r"skipped 1 damaged checkpoint and returns .*step0, "
                      r"the newest that verifies: .*step1: cannot read .*manifest.json"):
        assert px.latest_checkpoint(tmp_path) == str(tmp_path / "step0")
