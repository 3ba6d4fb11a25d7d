"""The step report of a rank whose backward raised (the step vote, engine/vote.py): the step
after the dropped one times its backward and its optimizer step as any other does. The
backward that raised never reached its end, so its start must not be carried into the next
step's report (a clock still counting from it saw no backward at all there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from step_vote_runs import BAD_STEP, Net, batch

import phalanx as px
from phalanx.testing import run_ranks


def _reports():
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = px.prepare(model, opt, strategy="ddp")
    reports = {}  # by the report's step: a step voted down makes none
    for step in range(BAD_STEP + 2):
        x, y = batch(step, 0, 4)
        if step == BAD_STEP and px.rank() == 1:
            px.unwrap(model).fault = "backward"
        try:
            F.mse_loss(model(x), y).backward()
        except torch.OutOfMemoryError:
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
        report = px.step_stats(model)
        reports[report["step"]] = report
    return reports


def test_the_step_after_a_backward_that_raised_reports_its_backward():
    for rank, reports in enumerate(run_ranks(_reports, 2, timeout=120)):
        assert sorted(reports) == list(range(BAD_STEP + 1)), rank
        after = reports[BAD_STEP]  # the step after the dropped one
        assert after["backward_s"] > 0, (rank, after)
        assert after["optimizer_s"] > 0, (rank, after)
        assert after["forward_s"] + after["backward_s"] + after["optimizer_s"] <= after["wall_s"]
