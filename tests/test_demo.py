"""The README's first command: `phalanx demo` trains on 2 processes and the loss goes down."""

import os
import re
import subprocess
import sys

import pytest

from phalanx.cli import main as phalanx_main


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


@pytest.mark.one_process
def test_help_names_every_strategy_with_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        phalanx_main(["demo", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "ddp, zero1, zero2 or zero3 (default ddp)" in text
    assert "fp32, bf16, fp16 or bf16-true (default fp32)" in text


@pytest.mark.one_process
@pytest.mark.parametrize("flag,value", [("--strategy", "zero4"), ("--precision", "fp8")])
def test_a_bad_name_is_one_argparse_error_and_starts_no_worker(capsys, monkeypatch, flag, value):
    import phalanx.launch.cli

    started = []
    monkeypatch.setattr(phalanx.launch.cli, "main", lambda args: started.append(args) or 0)
    with pytest.raises(SystemExit) as exit_:
        phalanx_main(["demo", flag, value])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert started == [] and out == ""
    usage, message = err.strip().split("\nphalanx demo: error: ")
    assert usage.startswith("usage: phalanx demo") and "Traceback" not in err
    assert message == f"argument {flag}: invalid choice: {value!r} " + (
        "(choose from 'ddp', 'zero1', 'zero2', 'zero3')" if flag == "--strategy"
        else "(choose from 'fp32', 'bf16', 'fp16', 'bf16-true')")
