"""What a rank reads after the job's end raises at once, saying why.

Once every rank has called torch's `destroy_process_group()` (or `px.shutdown()`), the ranks
that held the other shards have ended ([Note: a rank's end] in src/phalanx/world/leaving.py). A rank
that then reads sharded state (zero2's `optimizer.state_dict()`, zero3's
`px.unwrap(model).state_dict()` or a forward) waited for an answer that never came, forever;
a training step under ddp went on with collectives that did nothing, as if the rank were the
whole job. Now each raises `px.JobEnded` at once, on every rank, and the job ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "launch_scripts" / "after_the_end.py"

CASES = [("zero2", "optimizer.state_dict", "destroy"),
         pytest.param("zero1", "optimizer.state_dict", "shutdown", marks=pytest.mark.slow),
         ("zero3", "unwrap.state_dict", "destroy"),
         ("zero3", "no_grad forward", "shutdown"),
         pytest.param("zero3", "training step", "destroy", marks=pytest.mark.slow),
         ("ddp", "training step", "destroy")]


@pytest.mark.parametrize("strategy,what,how", CASES)
def test_a_read_after_the_end_raises_at_once_on_every_rank(strategy, what, how):
    result = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(SCRIPT),
                             strategy, what, how], capture_output=True, text=True, timeout=120)
    said = [line for line in result.stdout.splitlines() if f"AFTER {what}" in line]
    assert len(said) == 2, f"{result.stdout}\n{result.stderr}"
    for line in said:
        assert "raised JobEnded" in line, line
        assert "before the end" in line and "destroy_process_group()" in line, line
    assert result.returncode == 0, result.stderr
