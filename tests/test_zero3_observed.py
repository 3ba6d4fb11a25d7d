"""zero3's traffic is seen like every other: its all-gathers, which run on a group of their own
("zero3:gathers"), are in the step report, watched by the hang watcher and bounded by the job's
timeout (a rank stuck before a forward used to leave its peers blocked in a gather that no
report named, for torch's default 30 minutes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import phalanx as px
from phalanx.faults.hangs import HANG_EXIT
from phalanx.testing import run_ranks

HANG = Path(__file__).parent / "launch_scripts" / "hang.py"


def _step_report_under_zero3():
    from parity import Chain

    torch.manual_seed(0)
    model = Chain([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy="zero3")
    for _ in range(3):
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return px.step_stats(model)


def test_the_step_report_counts_zero3s_gathers():
    for report in run_ranks(_step_report_under_zero3, 2, timeout=90):
        # three blocks, each gathered in forward and again in backward but the last one
        assert report.get("all_gather/count", 0) >= 3, sorted(report)
        assert report["all_gather/bytes"] >= 3 * (32 * 32 + 32) * 4, report
        assert report["comm_bytes"] >= report["all_gather/bytes"] + report["all_reduce/bytes"]
        assert report["step"] == 2


def test_a_rank_stuck_before_a_zero3_forward_is_reported_on_the_gathers_group():
    env = dict(os.environ, PHALANX_HANG_AFTER="3")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(HANG),
                             "sleep", "zero3"], capture_output=True, text=True, timeout=120,
                            env=env)
    took = time.monotonic() - start
    err = result.stderr
    assert result.returncode != 0 and f"exited with code {HANG_EXIT}" in err, err[-3000:]
    # rank 0 gathers the model for step 3's forward; rank 1 sleeps outside any collective
    assert "hang at step 3: rank 1 has not entered all_gather #" in err, err[-3000:]
    assert ":unshard) on group 'zero3:gathers'; rank 0 has waited" in err, err[-3000:]
    line = HANG.read_text().splitlines().index("        time.sleep(600)") + 1
    assert f"hang.py:{line} in <module>: time.sleep(600)" in err, err[-3000:]
    assert took < 40, took
