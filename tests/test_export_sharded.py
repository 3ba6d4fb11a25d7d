"""`px.export` streams (checkpoint/export.py): one safetensors file or Hugging Face's sharded
layout, in the saved dtypes or a chosen one, written one tensor at a time on rank 0.

Against one process, in float64: at 2 ranks under ddp, zero2 and zero3, what
`safetensors.torch.load_file` reads back equals the model's state_dict exactly (a tied weight
under both names), cast to the chosen dtype; the sharded layout's index names every tensor's
file and the total size, files in the module's order, no tensor split. Rank 0's peak resident
memory rises during an export by less than one unit plus 10% of the fp32 model. Bad arguments
are refused before any collective, naming the fix; so is `merge_lora=True` on a model with no
LoRA layer (tests/test_export_lora.py exports LoRA models).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from checkpoint_runs import K, make_model, make_optimizer, state_of, train_steps
from resident import peak_rise
from torch import nn

import phalanx as px
from phalanx.checkpoint.export import INDEX
from phalanx.testing import run_ranks

SHARD = 600  # bytes: TiedLM's float64 tensors go to several files, some alone in theirs


def _exports(path, model):
    """The three exports every case checks."""
    px.export(path + ".safetensors", model)
    px.export(path + ".sharded", model, max_shard_size=SHARD)
    px.export(path + ".bf16", model, dtype=torch.bfloat16, max_shard_size="1KB")


def _trained(path, strategy, train):
    model = make_model(0)
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy)
    if train:
        train_steps(model, opt, K, 0, px.world_size(), px.rank())
    _exports(path, model)
    held = state_of(model, opt)[0]  # a collective under zero: on every rank
    return held if px.rank() == 0 else None


def _read_sharded(directory):
    """The sharded layout read back: every tensor by name, and the index."""
    from safetensors.torch import load_file

    with open(os.path.join(directory, INDEX)) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert sorted(f for f in os.listdir(directory)) == sorted(files + [INDEX])
    n = len(files)
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    tensors = {}
    for name in files:
        part = load_file(os.path.join(directory, name))
        assert {k for k, v in index["weight_map"].items() if v == name} == set(part)
        assert not set(part) & set(tensors)  # a tensor in one file only
        tensors.update(part)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values())
    return tensors, index


def _check(path, want: dict):
    """The three exports against `want` (the module's state_dict, float64)."""
    from safetensors.torch import load_file

    single = load_file(path + ".safetensors")
    assert list(single) != [] and set(single) == set(want)
    for name, value in want.items():
        assert single[name].dtype == value.dtype and torch.equal(single[name], value), name
    sharded, index = _read_sharded(path + ".sharded")
    assert list(index["weight_map"]) == list(want)  # the module's order
    files = [index["weight_map"][name] for name in want]
    assert files == sorted(files) and len(set(files)) > 2  # in order, over several files
    for name in set(files):
        size = sum(v.numel() * 8 for k, v in want.items() if index["weight_map"][k] == name)
        alone = sum(1 for k in want if index["weight_map"][k] == name) == 1
        assert size <= SHARD or alone, name  # over the limit only for a tensor alone
    for name, value in want.items():
        assert torch.equal(sharded[name], value), name
    cast, _ = _read_sharded(path + ".bf16")
    for name, value in want.items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert cast[name].dtype == expected.dtype and torch.equal(cast[name], expected), name


@pytest.mark.one_process
def test_one_process_exports_the_state_dict_exactly(tmp_path):
    model = make_model(0)
    path = str(tmp_path / "m")
    _exports(path, model)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert "head.weight" in want and "embed.weight" in want  # the tied weight, both names
    _check(path, want)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_two_ranks_export_what_one_process_has(tmp_path, strategy):
    path = str(tmp_path / "m")
    run_ranks(_trained, 2, args=(path, strategy, False), timeout=120)
    _check(path, {k: v.detach().clone() for k, v in make_model(0).state_dict().items()})


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_trained_masters_are_exported(tmp_path, strategy):
    path = str(tmp_path / "m")
    held = run_ranks(_trained, 2, args=(path, strategy, True), timeout=120)[0]
    untrained = make_model(0).state_dict()
    assert not torch.equal(held["inp.weight"], untrained["inp.weight"])  # training moved it
    _check(path, held)


def test_an_export_replaces_an_earlier_one_and_its_extra_shards(tmp_path):
    path = str(tmp_path / "m")
    model = make_model(0)
    px.export(path, model, max_shard_size=100)
    many = len(os.listdir(path))
    px.export(path, model, max_shard_size="1MB")
    assert many > 2 and sorted(os.listdir(path)) == sorted(
        ["model-00001-of-00001.safetensors", INDEX])
    assert _read_sharded(path)[0].keys() == model.state_dict().keys()


# -- arguments ----------------------------------------------------------------------------------
@pytest.mark.one_process
@pytest.mark.parametrize("kwargs,error,fix", [
    ({"dtype": torch.int32}, TypeError, "floating torch dtype"),
    ({"dtype": "bf16"}, TypeError, "torch.bfloat16"),
    ({"max_shard_size": "5 apples"}, ValueError, "5GB"),
    ({"max_shard_size": 0}, ValueError, "above 0"),
    ({"max_shard_size": "5GB", "path": "model.safetensors"}, ValueError, "name a directory"),
    ({"path": "DIR"}, px.CheckpointError, "is a directory"),
    ({"merge_lora": True}, ValueError, "and this model has none (no module holding `base_layer` "
                                       "beside `lora_A` and `lora_B`"),
])
def test_bad_arguments_are_refused_naming_the_fix(tmp_path, kwargs, error, fix):
    kwargs = dict(kwargs)
    path = kwargs.pop("path", "out")
    path = str(tmp_path) if path == "DIR" else str(tmp_path / path)
    with pytest.raises(error, match=re.escape(fix)):
        px.export(path, make_model(0), **kwargs)
    assert os.listdir(tmp_path) == []  # nothing written


@pytest.mark.one_process
def test_a_dtype_safetensors_cannot_name_is_refused_before_anything_is_written(tmp_path):
    model = nn.Linear(3, 2)
    model.register_buffer("phase", torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"phase \(torch.complex64\).*convert them"):
        px.export(str(tmp_path / "m.safetensors"), model)
    assert os.listdir(tmp_path) == []


def test_the_command_line_export_takes_dtype_and_max_shard_size(tmp_path):
    model = make_model(0)
    px.save(str(tmp_path / "ckpt"), model=model)
    out = str(tmp_path / "out")
    done = subprocess.run([sys.executable, "-m", "phalanx", "export", str(tmp_path / "ckpt"), out,
                           "--dtype", "bfloat16", "--max-shard-size", str(SHARD)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    got, index = _read_sharded(out)
    want = model.state_dict()
    assert set(got) == set(want) and len(set(index["weight_map"].values())) > 2
    for name, value in want.items():
        assert torch.equal(got[name], value.to(torch.bfloat16) if value.is_floating_point()
                           else value), name


# -- memory -------------------------------------------------------------------------------------
LAYERS, WIDTH = 24, 1024  # 24 layers of 4 MiB: a 100 MB fp32 model


def _peak_rise(path, strategy):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    model = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)[0]
    px.export(path + ".warm", model, max_shard_size="1GB")  # first use: imports, buffers
    return [peak_rise(lambda i=i, kw=kw: px.export(
        path + str(i) + ("" if kw else ".safetensors"), model, **kw))
        for i, kw in enumerate(({}, {"max_shard_size": "20MB"}))]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's VmHWM reset")
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_rank_0s_peak_memory_rises_by_less_than_a_unit_plus_a_tenth(tmp_path, strategy):
    rises = run_ranks(_peak_rise, 2, args=(str(tmp_path / "m"), strategy), timeout=300)[0]
    unit = (WIDTH * WIDTH + WIDTH) * 4  # one layer, fp32
    bound = unit + 0.1 * LAYERS * unit
    assert max(rises) < bound, (rises, bound)
    print(f"{strategy}: rank 0's peak rise {[r / 1e6 for r in rises]} MB, bound {bound / 1e6} MB")

