"""An argument in the wrong place names the call, what it was given and the call that works,
before anything happens (issue 37, item 4; px.prepare's in test_prepare_options.py). A world of
one: the checks come before any collective, so every rank of a job raises the same error."""

from __future__ import annotations

import pytest
import torch
from small_mlp import mlp

import phalanx as px

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)


@pytest.fixture
def trained(tmp_path):
    model = mlp()
    model, opt = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return model, opt


def test_save_and_load_name_a_model_where_the_path_goes(trained, tmp_path):
    model, opt = trained
    with pytest.raises(TypeError, match=r"^px\.save: the first argument is the checkpoint's "
                                        r"directory \(a str or os\.PathLike\), not the module "):
        px.save(model, tmp_path / "ckpt")
    with pytest.raises(TypeError, match=r"^px\.load: the first argument is the checkpoint's "):
        px.load(model, tmp_path / "ckpt")
    with pytest.raises(TypeError, match=r"^px\.save\(model=\.\.\.\): the model goes there.*not "
                                        r"the optimizer SGD"):
        px.save(tmp_path / "ckpt", opt)
    with pytest.raises(TypeError, match=r"^px\.load: optimizer= takes the optimizer px\.prepare "
                                        r"returned, not the module "):
        px.load(tmp_path / "ckpt", model, model)
    with pytest.raises(TypeError, match=r"^px\.export\(path, model\): the first argument is the "
                                        r"file to write .*: px\.export\('model\.safetensors', "
                                        r"model\)$"):
        px.export(model, tmp_path / "model.safetensors")
    with pytest.raises(TypeError, match=r"^px\.latest_checkpoint\(directory\): the first "):
        px.latest_checkpoint(model)
    assert list(tmp_path.iterdir()) == []  # nothing was written
    assert px.save(tmp_path / "ckpt", model=model, optimizer=opt)  # the right call works


def test_data_loader_names_a_batch_size_where_the_dataset_goes():
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    with pytest.raises(TypeError, match=r"^px\.data_loader\(dataset, batch_size, \.\.\.\): the "
                                        r"first argument is the dataset .*not int 4; the dataset "
                                        r"comes first: px\.data_loader\(dataset, 4\)$"):
        px.data_loader(4, data)
    assert len(px.data_loader(data, 4)) == 2


def test_spawn_names_what_is_not_a_function():
    with pytest.raises(TypeError, match=r"its first argument is int 2, not a function"):
        px.spawn(2, print)


def test_log_names_what_is_not_a_dict():
    with pytest.raises(TypeError, match=r"^px\.log\(metrics, step=None\) takes a dict of name "
                                        r"-> number, not str 'loss'"):
        px.log("loss", 0.5)
