"""The README's first command: `phalanx demo` trains on 2 processes and the loss goes down."""

import os
import re
import subprocess
import sys


def _epochs(text):
    return [(float(loss), float(acc)) for loss, acc in
            re.findall(r"train loss ([0-9.]+)\s+test accuracy\s+([0-9.]+)%", text)]


def test_demo_trains_on_two_processes_like_one():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    two = subprocess.run([sys.executable, "-m", "phalanx", "demo", "--epochs", "4"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stdout + two.stderr
    one = subprocess.run([sys.executable, "-m", "phalanx.demo", "--epochs", "4"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr
    assert "2 process(es)" in two.stdout
    got, want = _epochs(two.stdout), _epochs(one.stdout)
    assert len(got) == len(want) == 4
    assert got[-1][0] < got[0][0]  # the loss goes down
    for (loss2, acc2), (loss1, acc1) in zip(got, want):
        # the same global batch and sample order: the same training, up to fp32 round-off
        assert abs(loss2 - loss1) <= 2e-3 * loss1 + 1e-4
        assert abs(acc2 - acc1) <= 0.5
