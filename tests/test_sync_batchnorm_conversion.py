"""convert_sync_batchnorm itself, in this process (no process group needed): it keeps
parameters, buffers, names, sharing and train/eval flags, converts a BatchNorm or a subclass of
one and leaves synchronized layers alone, and explains what it cannot convert. Training with the
converted layers on real ranks: test_sync_batchnorm.py.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from phalanx.model.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)


class _MyNorm(nn.BatchNorm2d):
    """A user's own BatchNorm subclass: converted too."""


def _net():
    shared = nn.BatchNorm1d(4)
    return nn.Sequential(
        nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3),
        nn.Sequential(nn.Conv3d(3, 3, 1), nn.BatchNorm3d(3, affine=False)),
        _MyNorm(3, track_running_stats=False),
        nn.ModuleDict({"a": shared, "b": shared}),
    )


def test_conversion_keeps_parameters_buffers_names_and_flags():
    model = _net()
    model[2][1].eval()
    before = model.state_dict(keep_vars=True)
    modes = [m.training for m in model.modules()]
    converted = convert_sync_batchnorm(model)
    assert converted is model
    norms = [model[1], model[2][1], model[3], model[4]["a"]]
    assert all(type(m) is SyncBatchNorm and isinstance(m, _BatchNorm) for m in norms)
    assert model[4]["a"] is model[4]["b"], "a shared BatchNorm stays shared"
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before), "the very same tensors"
    assert [m.training for m in model.modules()] == modes
    assert model[2][1].training is False and model[1].training is True
    assert model[3].running_mean is None and model[2][1].weight is None

    modules = list(model.modules())
    assert convert_sync_batchnorm(model) is model
    assert list(model.modules()) == modules, "converting twice changes nothing"

    plain = _net()
    plain.load_state_dict(model.state_dict())  # checkpoints load into the unconverted model
    model.load_state_dict(plain.state_dict())


def test_a_batchnorm_itself_and_already_synchronized_layers():
    bn = nn.BatchNorm2d(3)
    sync = convert_sync_batchnorm(bn)
    assert type(sync) is SyncBatchNorm and sync.weight is bn.weight
    assert sync.running_var is bn.running_var and sync.num_features == 3
    assert (sync.eps, sync.momentum, sync.affine) == (bn.eps, bn.momentum, bn.affine)
    assert convert_sync_batchnorm(sync) is sync
    torch_sync = nn.SyncBatchNorm(3)
    assert convert_sync_batchnorm(torch_sync) is torch_sync
    copy.deepcopy(sync)  # no process group is stored by default


def test_clear_errors():
    with pytest.raises(ValueError, match="lazy .* run one forward pass"):
        convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))
    layer = convert_sync_batchnorm(nn.BatchNorm1d(3)).eval()
    with pytest.raises(ValueError, match="2D to 5D"):
        layer(torch.randn(3))
