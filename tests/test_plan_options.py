"""px.plan's options: four frozen groups (planner/setting.py) that its keywords build, px.prepare's
Spec planned as it is, and the planner asking px.prepare's meanings (the residency rows, the
table of combinations, the engine's shard_size rules), never the names."""

import ast
import glob
import os
from dataclasses import replace

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.engine.hybrid import check_shard_size
from phalanx.engine.policy import POLICIES, placed
from phalanx.model.spec import Spec
from phalanx.planner import Hardware, Report, Training, Workload
from phalanx.planner.setting import check_setting, groups
from phalanx.spec.precisions import PLANNER_PRECISIONS, PRECISION_ALIASES
from phalanx.spec.strategies import STRATEGIES, STRATEGY_ALIASES

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)

PLANNER = os.path.join(os.path.dirname(__file__), "..", "src", "phalanx", "planner")


def test_the_keywords_build_the_groups():
    keywords = dict(gpus=4, nodes=2, gpu="a100", link="10Gbit+1ms", batch=2, seq=512,
                    optimizer="adam", precision="fp16", prefetch=2, shard_size=2, headroom=0.2,
                    units="GiB")
    by_keywords = px.plan(params=2e9, **keywords)
    by_groups = px.plan(params=2e9, hardware=Hardware(gpus=4, nodes=2, gpu="a100",
                                                      link="10Gbit+1ms"),
                        workload=Workload(batch=2, seq=512, optimizer="adam"),
                        training=Training(precision="fp16", prefetch=2, shard_size=2),
                        report=Report(headroom=0.2, units="GiB"))
    assert by_groups.to_dict() == by_keywords.to_dict()
    assert str(by_groups) == str(by_keywords)
    assert by_keywords.setting["shard_size"] == 2 and by_keywords.units == "GiB"


def test_keywords_go_over_a_group_given_whole():
    node = Hardware(gpus=8, gpu="a100", gpu_memory="40GB")
    got = px.plan(params=8e9, hardware=node, gpus=2, precision="fp32")
    assert got.to_dict() == px.plan(params=8e9, gpus=2, gpu="a100", gpu_memory="40GB",
                                    precision="fp32").to_dict()
    assert got.setting["world_size"] == 2 and node.gpus == 8


def test_a_keyword_no_group_has_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"plan\(\) got an unexpected keyword argument "
                                        r"'gpu_count'"):
        px.plan(params=8e9, gpu_count=8)
    with pytest.raises(TypeError, match="takes hardware= as a Hardware"):
        px.plan(params=8e9, hardware={"gpus": 8})
    with pytest.raises(TypeError, match="training= or spec="):
        px.plan(params=8e9, training=Training(), spec=Spec.of("ddp"))


def test_a_group_checks_itself_and_resolves_what_it_was_given_each_time_it_is_made():
    with pytest.raises(ValueError, match="gpus must be a positive integer, got 0"):
        Hardware(gpus=0)
    with pytest.raises(ValueError, match="unknown strategy 'zero4': choose one of ddp, zero1, "
                                         "zero2, zero3, fsdp, all"):
        Training(strategy="zero4")
    with pytest.raises(ValueError, match="headroom must be in"):
        replace(Report(), headroom=1)
    assert Training(strategy="FSDP").strategy == "zero3"
    assert Training(precision="bf16-mixed").precision is PLANNER_PRECISIONS["bf16"]
    assert Training(comm_dtype="bf16").comm is torch.bfloat16
    assert Hardware(gpu="rtx3090").memory == 24e9
    assert replace(Hardware(gpu="rtx3090"), gpu="a100-40gb").memory == 40e9  # made again
    assert replace(Hardware(gpu_memory="16GB"), gpus=2).memory == 16e9
    assert Workload(lora_rank=8).targets == ("q_proj", "v_proj")
    assert Report(units="gib").units == "GiB"


def test_a_spec_is_planned_as_px_prepare_resolved_it():
    spec = Spec.of("fsdp", "bf16-mixed", prefetch=2, max_gathered_mb=64, offload="optimizer",
                   bucket_mb=10, comm_dtype="bf16")
    got = px.plan(params=1e9, gpus=4, spec=spec)
    want = px.plan(params=1e9, gpus=4, strategy="zero3", precision="bf16", prefetch=2,
                   max_gathered_mb=64, offload="optimizer", bucket_mb=10,
                   comm_dtype=torch.bfloat16)
    assert list(got.strategies) == ["zero3"]
    assert got.to_dict() == want.to_dict()
    # keywords go over the spec's options: every strategy the offload goes with
    assert list(px.plan(params=1e9, gpus=4, spec=spec, strategy="all").strategies) == \
        ["zero1", "zero2", "zero3"]


def test_a_spec_with_a_feature_the_plan_does_not_model_is_refused_by_name():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    for spec, what in ((Spec.of("zero2", staleness=1), "staleness=1"),
                       (Spec.of("zero2", compression=px.PowerSGD(rank=2)), "compression="),
                       (Spec.of(px.DiLoCo(sync_every=4), optimizer=opt), "strategy=DiLoCo")):
        with pytest.raises(ValueError, match=f"the spec has {what}.*which the plan does not"):
            px.plan(params=1e9, gpus=2, spec=spec)


def _prepare_takes(strategy, offload) -> bool:
    try:
        Spec.of(strategy, offload=offload)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offload_goes_with_the_rows_px_prepares_table_lets_it(offload):
    planned = px.plan(params=1e9, gpus=2, offload=offload)
    assert list(planned.strategies) == [s for s in STRATEGIES if _prepare_takes(s, offload)]
    setting = check_setting(*groups({"offload": offload, "gpus": 2}))
    # each planned strategy is its residency row with offload's places; ddp's, refused, is
    # planned bare for the link report
    assert setting.candidates == tuple(placed(POLICIES[s], offload) for s in planned.strategies)
    assert setting.rows[0] is POLICIES["ddp"]
    assert setting.rows[1:] == tuple(placed(POLICIES[s], offload) if _prepare_takes(s, offload)
                                     else POLICIES[s] for s in STRATEGIES[1:])


@pytest.mark.parametrize("shard_size,strategy,engine_strategy", [
    (3, "all", "zero2"), (1, "zero1", "zero1"), ("x", "zero3", "zero3"), (2, "ddp", "ddp"),
    (0, "all", "zero1")])
def test_shard_size_follows_the_engines_rules(shard_size, strategy, engine_strategy):
    with pytest.raises(ValueError) as engine:
        check_shard_size(shard_size, POLICIES[engine_strategy], 4)
    with pytest.raises(ValueError) as planned:
        px.plan(params=1e9, gpus=4, shard_size=shard_size, strategy=strategy)
    assert str(planned.value) == str(engine.value)


def test_shard_size_node_is_the_plans_gpus_per_node_and_text_is_a_number():
    assert px.plan(params=1e9, gpus=2, nodes=2, shard_size="node").setting["shard_size"] == 2
    assert px.plan(params=1e9, gpus=2, nodes=2, shard_size=" 2 ").setting["shard_size"] == 2
    assert px.plan(params=1e9, gpus=4, shard_size=4).setting["shard_size"] is None  # the world
    # ddp beside the others is planned in the flat layout
    flat = px.plan(params=1e9, gpus=2, nodes=2, strategy="ddp")["ddp"]
    assert px.plan(params=1e9, gpus=2, nodes=2, shard_size=2)["ddp"] == flat


def test_the_planner_asks_meanings_not_names():
    """No comparison in planner/ names a strategy or a precision: the rows, the PrecisionSpec
    and the table of combinations say what a name means."""
    names = set(STRATEGIES) | set(STRATEGY_ALIASES) | set(PLANNER_PRECISIONS) \
        | set(PRECISION_ALIASES)
    found = []
    for path in sorted(glob.glob(os.path.join(PLANNER, "*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                for operand in (node.left, *node.comparators):
                    found += [f"{os.path.basename(path)}:{node.lineno} {c.value!r}"
                              for c in ast.walk(operand)
                              if isinstance(c, ast.Constant) and c.value in names]
    assert not found, f"names compared in planner/: {', '.join(found)}"
    assert names >= {"zero3", "fsdp", "fp16", "bf16-mixed"}  # the scan looks for these
