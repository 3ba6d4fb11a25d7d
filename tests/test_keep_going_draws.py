"""A step redone after a loss says that random draws differ from then on, where the model draws
(continuing/events.py's [Note: random draws after a recovery]): each rank draws dropout's masks
from its own generator for its part of a batch, and the batch is split over fewer ranks now,
so the run goes on with the same samples but not the same draws. It said only 'step 3 redone
by 2 ranks' (a run with Dropout ended 0.075 from the uninterrupted one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "launch_scripts" / "keep_going_dropout.py"


@pytest.mark.parametrize("p", [0.3, pytest.param(0.0, marks=pytest.mark.slow)])
def test_the_recovery_line_says_the_draws_differ_where_the_model_draws(tmp_path, p):
    result = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "3", "--on-failure",
                             "continue", "--max-restarts", "0", str(SCRIPT), str(tmp_path), str(p)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    line = next(l for l in result.stderr.splitlines() if "redone by 2 ranks" in l)
    said = "the model's Dropout draws after the loss differ from the uninterrupted run's"
    assert (said in line) == (p > 0), line
