"""A checkpoint's files: px.export and `phalanx export` write weights a plain model loads (bf16
masters in fp32), a damaged checkpoint or one of another model is refused on every rank naming
what is wrong and leaving the model unchanged, and `phalanx checkpoint info` describes and
verifies one.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from checkpoint_runs import K, TiedLM, make_batch, make_model, make_optimizer, train_steps

import phalanx as px
from phalanx.testing import run_ranks


# -- bf16 masters, export ----------------------------------------------------------------------
def _save_bf16_and_export(path, export_path):
    torch.manual_seed(0)
    model = TiedLM()  # fp32 masters, bf16 compute
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2", precision="bf16")
    train_steps(model, opt, K, 0, px.world_size(), px.rank())
    px.save(path, model=model, optimizer=opt)
    px.export(export_path, model)
    return True


def test_bf16_zero2_masters_load_into_a_plain_fp32_model_and_export_matches(tmp_path):
    from safetensors.torch import load_file

    path, exported = str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")
    run_ranks(_save_bf16_and_export, 2, args=(path, exported))
    weights = load_file(exported)
    assert all(t.dtype == torch.float32 for t in weights.values())
    plain = TiedLM()
    plain.load_state_dict(weights)  # every name, the tied one included
    loaded = TiedLM()
    px.load(path, model=loaded)  # a world of one, no prepare
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, weights[name]), name
    # the masters carry what bf16 cannot: they are not bf16 values widened
    trained = weights["inp.weight"]
    assert not torch.equal(trained, trained.bfloat16().float())
    # the offline export of the checkpoint is the same file's content
    offline = str(tmp_path / "offline.safetensors")
    px.checkpoint.export_checkpoint(path, offline)
    again = load_file(offline)
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[k], weights[k]) for k in weights)


def test_phalanx_export_command_writes_weights_the_plain_model_loads(tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file

    model = make_model(0)
    px.save(tmp_path / "ckpt", model=model)
    out = tmp_path / "weights.safetensors"
    done = subprocess.run([sys.executable, "-m", "phalanx", "export", str(tmp_path / "ckpt"),
                           str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plain = TiedLM().double()
    plain.load_state_dict(load_file(out))
    tokens = make_batch(0)
    assert torch.equal(plain(tokens), model(tokens))
    bad = subprocess.run([sys.executable, "-m", "phalanx", "export", str(tmp_path / "nothing"),
                          str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr == f"phalanx export: error: no checkpoint at {tmp_path / 'nothing'}: " \
                         "not a directory\n"


# -- integrity and mismatches: an error on every rank, nothing changed ---------------------------
def _save_one(path):
    model = make_model(0)
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2")
    train_steps(model, opt, 1, 0, px.world_size(), px.rank())
    px.save(path, model=model, optimizer=opt, step=1)
    return True


def _load_must_fail(path, words, other_model=False):
    model = nn.Linear(3, 3).double() if other_model else make_model(3)
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2")
    before = {k: v.clone() for k, v in px.unwrap(model).state_dict().items()}
    try:
        px.load(path, model=model, optimizer=opt)
    except px.CheckpointError as exc:
        message = str(exc)
    else:
        raise AssertionError("px.load did not raise")
    after = px.unwrap(model).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing half-loaded
    for word in words:
        assert word in message, message
    return message


def _flip_a_byte(path):
    _flip_a_byte_of(os.path.join(path, "rank00001.safetensors"))
    return ["rank00001.safetensors", "checksum"]


def _truncate(path):
    name = os.path.join(path, "rank00000.safetensors")
    with open(name, "r+b") as f:
        f.truncate(os.path.getsize(name) - 10)
    return ["rank00000.safetensors", "truncated"]


def _drop_manifest(path):
    os.remove(os.path.join(path, "manifest.json"))
    return ["manifest.json is missing"]


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate, _drop_manifest])
def test_a_damaged_checkpoint_is_refused_on_every_rank_naming_the_file(tmp_path, damage):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_one, 2, args=(path,))
    words = damage(path)
    messages = run_ranks(_load_must_fail, 2, args=(path, words))
    assert len(messages) == 2


def test_a_checkpoint_of_another_model_names_what_differs(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_one, 2, args=(path,))
    run_ranks(_load_must_fail, 2, args=(path, ["missing from the checkpoint: weight, bias",
                                               "not in the model: embed.weight"], True))
    # strict=False loads what matches, and says what it left out
    model = TiedLM().double()
    model.inp = nn.Linear(8, 17).double()  # another shape
    with pytest.warns(UserWarning, match=r"other shapes: inp\.weight \(16, 8\) -> \(17, 8\)"):
        px.load(path, model=model, strict=False)
    reference = TiedLM().double()
    px.load(path, model=reference)
    assert torch.equal(model.out.weight, reference.out.weight)


@pytest.mark.one_process
def test_checkpoint_info_describes_and_verifies(tmp_path, capsys):
    from phalanx import cli

    model = make_model(0)
    opt = make_optimizer(model)
    train_steps(model, opt, 1, 0, 1, 0)
    px.save(tmp_path / "ckpt", model=model, optimizer=opt, step=1)
    assert cli.main(["checkpoint", "info", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "at step 1, 1 rank(s)" in out
    assert "embed.weight" in out and "(11, 8) float64" in out
    assert "head.weight                              (the same tensor as embed.weight)" in out
    assert "optimizer state: exp_avg, exp_avg_sq" in out
    assert "integrity: every file matches its size and CRC-32" in out
    _flip_a_byte_of(tmp_path / "ckpt" / "rank00000.safetensors")
    assert cli.main(["checkpoint", "info", str(tmp_path / "ckpt")]) == 1
    assert "rank00000.safetensors does not match its checksum" in capsys.readouterr().out
    assert cli.main(["checkpoint", "info", str(tmp_path)]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err


def _flip_a_byte_of(name):
    with open(name, "r+b") as f:
        f.seek(os.path.getsize(name) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
