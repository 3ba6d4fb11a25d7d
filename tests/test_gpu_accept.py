"""benchmarks/gpu_accept.py, the GPU acceptance suite, as far as a machine without a GPU can run
it: with no CUDA it says so and exits 0 with every check skipped, and its checks' code runs on
the CPU at small sizes (--cpu-dry-run), so a broken check is found before a GPU is lent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_accept.py"


def _checks() -> dict:
    """The suite's registry of checks (benchmarks/gpu_checks.py), so that the counts below
    follow the checks it has rather than a number written here."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_checks import CHECKS  # registers every module's checks
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return CHECKS


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the suite")
def test_without_cuda_every_check_is_skipped_and_the_exit_status_is_0():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "No CUDA device: every check skipped" in done.stdout
    assert f"0 passed, 0 failed, {len(_checks())} skipped" in done.stdout


@pytest.mark.slow  # two to three minutes on 2 cores: every check of the suite, on the CPU
def test_the_checks_run_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run", "--json",
                           str(tmp_path / "rows.jsonl")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = (tmp_path / "rows.jsonl").read_text().splitlines()
    checks = _checks()
    dry = sum(c.dry for c in checks.values())
    assert len(rows) == len(checks)
    assert f"{dry} passed, 0 failed, {len(checks) - dry} skipped" in done.stdout, \
        done.stdout[-3000:]
