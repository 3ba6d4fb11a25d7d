"""`phalanx report`'s plan of a logged zero3 run against the bytes the run's collectives moved.

The report knows the run only from what px.prepare recorded (RUN_DIR/run.json): a parameter
count, which cannot say which of zero3's units stay gathered from forward into backward, and
the roots the engine gathers together, which can. Two models on 2 ranks: the demo's, all of it
in one unit rooted at the model itself (kept into backward: one gather per step), and one of
repeated blocks, each a root freed after its forward and gathered again in backward (all but
the last, with which backward starts); the second again with `reshard_after_forward=False`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.demo import model as demo_model
from phalanx.observe.report_cli import against_plan, plan_for_run, read_metrics
from phalanx.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
from parity import Chain

STEPS = 4


def blocks_model():
    """An input layer, four repeated blocks and a head: six roots, none of them the model."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 48),
                         Chain([nn.Sequential(nn.Linear(48, 48), nn.Tanh()) for _ in range(4)]),
                         nn.Linear(48, 3))


CASES = {"model-rooted": (demo_model, {}),
         "blocks": (blocks_model, {}),
         "blocks-kept": (blocks_model, {"reshard_after_forward": False})}


def _logged_run(run_dir, case):
    os.environ["PHALANX_RUN_DIR"] = run_dir
    px.init()
    build, options = CASES[case]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, opt = px.prepare(model, opt, strategy="zero3", **options)
    for step in range(STEPS):
        model(torch.randn(8, 2)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        px.log(px.step_stats(model), step, every=0)


@pytest.mark.parametrize("case", list(CASES))
def test_report_plans_zero3_gathers_as_the_engine_runs_them(tmp_path, case):
    run_dir = str(tmp_path / case)
    run_ranks(_logged_run, 2, args=(run_dir, case), timeout=120)
    with open(os.path.join(run_dir, "run.json")) as f:
        run = json.load(f)
    planned = plan_for_run(run).comm_payload_bytes
    series = read_metrics(run_dir)
    # the first step gathers the last root again (no forward order yet) and re-lays buckets
    measured = statistics.median(v for _, v in series["all_gather/bytes"][1:])
    params = 4 * sum(p.numel() for p in CASES[case][0]().parameters())
    twice = {"model-rooted": 0, "blocks": params - 4 * (48 * 3 + 3), "blocks-kept": 0}[case]
    # what the planner says: one gather of everything, and again what backward gathers
    assert planned["all_gather"] == params + twice, planned
    # shards are padded to a multiple of the world size; the roots' signature is 32 bytes
    assert measured == pytest.approx(planned["all_gather"], rel=2e-3), (measured, planned)
    text = against_plan(run_dir, series)
    row = next(line for line in text.splitlines() if "all_gather bytes/step" in line)
    shown_planned, shown_measured = float(row.split()[2]), float(row.split()[4])
    assert abs(shown_planned - shown_measured) <= 0.002 * shown_planned, text
    assert "did not record zero3's roots" not in text


@pytest.mark.one_process
def test_report_of_a_zero3_run_without_its_roots_says_what_it_assumed(tmp_path):
    # run.json as px.prepare wrote it before it recorded zero3's roots
    run = {"strategy": "zero3", "precision": "fp32", "world": 2, "backend": "gloo",
           "device": "cpu", "bucket_mb": 25.0, "comm_dtype": None, "trainable_params": 17283,
           "optimizer": "adamw"}
    (tmp_path / "run.json").write_text(json.dumps(run))
    series = {"wall_s": [(1, 0.01), (2, 0.01)], "all_gather/bytes": [(1, 7e4), (2, 7e4)]}
    text = against_plan(str(tmp_path), series)
    assert f"{2 * 17283 * 4 / 1e3:.1f} kB" in text  # every unit gathered twice, 4 bytes each
    assert "this run did not record zero3's roots: backward is planned to gather every unit " \
           "again" in text, text
