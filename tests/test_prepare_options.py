"""px.prepare's options checked: one that differs between ranks fails on every rank naming it,
and a bucket_mb that is not a finite number is refused (items 6 and 14 of the issue "Defects
found by running real training code"; px.init's options are in test_runtime.py).
"""

import pytest
import torch
import torch.nn as nn
from small_mlp import mlp

import phalanx as px
from phalanx.testing import RanksFailed, run_ranks

# -- options that differ between ranks --------------------------------------------------
MISMATCHES = {
    "comm_dtype": (torch.float16, torch.bfloat16),
    "strategy": ("zero1", "zero2"),
    "precision": ("bf16", "fp16"),
    "bucket_mb": (25.0, 1.0),
    "broadcast_buffers": (True, False),
    "sync_batchnorm": (False, True),
}


def _mismatched_option(option):
    kwargs = {option: MISMATCHES[option][px.rank() % 2]}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


@pytest.mark.parametrize("option", list(MISMATCHES))
def test_an_option_that_differs_between_ranks_fails_on_every_rank_naming_it(option):
    with pytest.raises(RanksFailed) as info:
        run_ranks(_mismatched_option, 2, args=(option,), timeout=30)
    text = str(info.value)
    assert "2 of 2 ranks failed" in text
    for rank in range(2):  # each rank's error itself (not its traceback) names the option
        message = text.split(f"--- rank {rank} failed:\n", 1)[1].split("\n", 1)[0]
        assert option in message, f"rank {rank}: {message}"


# -- bucket_mb that is not a finite number ---------------------------------------------
@pytest.mark.one_process
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
@pytest.mark.parametrize("bucket_mb", [float("inf"), float("nan")])
def test_bucket_mb_must_be_finite(strategy, bucket_mb):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="bucket_mb"):
        px.prepare(model, opt, strategy=strategy, bucket_mb=bucket_mb)


# -- the model and the optimizer where they go (issue 37, item 4) ----------------------------
@pytest.mark.one_process
@pytest.mark.parametrize("second,words", [
    ("sgd", ("the second argument is the optimizer itself, a torch.optim.Optimizer built over "
             "model.parameters() such as torch.optim.SGD(model.parameters(), lr=0.1), not its "
             "name 'sgd'; the strategy is a keyword: strategy='ddp'")),
    ("zero3", ("the second argument is the optimizer, and 'zero3' is a strategy: pass it as a "
               "keyword, px.prepare(model, optimizer, strategy='zero3') (or px.prepare(model, "
               "strategy='zero3') without an optimizer)")),
    (torch.optim.SGD, ("the optimizer class SGD was passed; pass an optimizer built over the "
                       "model's parameters, SGD(model.parameters(), lr=...)")),
    (0.1, ("the optimizer goes there, a torch.optim.Optimizer built over model.parameters() "
           "such as torch.optim.SGD(model.parameters(), lr=0.1) (or None), not float 0.1")),
])
def test_prepare_names_what_went_where_the_optimizer_goes(second, words):
    # it was: AttributeError: 'str' object has no attribute 'param_groups'
    model = mlp()
    with pytest.raises(TypeError) as caught:
        px.prepare(model, second)
    assert str(caught.value) == f"px.prepare(model, optimizer, strategy=...): {words}"
    assert px.unwrap(model) is model  # nothing was done to the model


@pytest.mark.one_process
def test_prepare_names_an_optimizer_given_first():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"the model goes first, a torch.nn.Module, not the "
                                        r"optimizer SGD \(the model comes first, then its "
                                        r"optimizer\)"):
        px.prepare(opt, model)


@pytest.mark.one_process
def test_the_precision_names_are_the_planners():
    """One vocabulary (phalanx/precisions.py): the planner's aliases and its pure-bf16 name
    mean the same here."""
    for alias, name in (("bf16-mixed", "bf16"), ("FP16-mixed", "fp16"), ("BF16", "bf16"),
                        ("bf16-true", "bf16-true")):
        assert _options("ddp", alias).precision.name == name
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        _options("ddp", "fp8")


@pytest.mark.one_process
def test_the_strategy_names_and_their_alias_are_one_list():
    """phalanx/strategies.py: px.prepare, PhalanxStrategy, the demo and the planner take the
    same names, in any case, and "fsdp" is zero3 everywhere."""
    from phalanx.demo import STRATEGIES as DEMO
    from phalanx.planner.setting import STRATEGIES as PLANNED
    from phalanx.spec.strategies import STRATEGIES

    assert DEMO == STRATEGIES and tuple(PLANNED) == STRATEGIES
    assert [_options(name).strategy for name in ("DDP", "zero1", "Zero2", "fsdp", "FSDP")] == \
        ["ddp", "zero1", "zero2", "zero3", "zero3"]
    with pytest.raises(ValueError, match=r"unknown strategy 'zero4'; choose one of 'ddp', "
                                         r"'zero1', 'zero2', 'zero3' \(alias 'fsdp' for "
                                         r"'zero3'\)"):
        _options("zero4")


def _options(strategy, precision="fp32"):
    """px.prepare's options checked, with every other option at its default."""
    from phalanx.model.spec import Spec

    return Spec.of(strategy, precision)
