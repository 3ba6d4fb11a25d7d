"""`phalanx plan --link` and `px.plan(link=...)`: the link parsed in bits or bytes, each
strategy's communication time over it with a verdict, and the PowerSGD and DiLoCo what-ifs,
against figures computed here from the model's own shapes (planner/link.py)."""

import json
import math

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.cli import main as phalanx_main
from phalanx.planner.link import parse_link

WORLD_NODES, GPUS = 4, 1
RANK, H = 4, 50


def build():
    """A model whose gradients PowerSGD shrinks (the two matrices) and does not (the biases)."""
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 256))


@pytest.mark.parametrize("text,bytes_per_s", [
    ("1Gbit", 1e9 / 8), ("10gbit", 10e9 / 8), ("100Mbit", 100e6 / 8), ("1Gbps", 1e9 / 8),
    ("2.5 Gbit/s", 2.5e9 / 8), ("25GB/s", 25e9), ("400MB/s", 400e6), ("1e3Mbit", 1e9 / 8)])
def test_link_in_bits_or_bytes(text, bytes_per_s):
    assert parse_link(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["1Gb", "1gb", "1", "fast", "0Gbit", "-1Gbit", "1Xbit", ""])
def test_bad_link_is_a_clear_error(text):
    with pytest.raises(ValueError, match="link"):
        parse_link(text)


def _expected(link_bytes_per_s):
    """The figures derived from the model's shapes: fp32 gradients, a ring of N ranks."""
    shapes = [tuple(p.shape) for p in build().parameters()]
    elem = torch.finfo(torch.float32).bits // 8
    n = WORLD_NODES * GPUS
    grad = elem * sum(math.prod(s) for s in shapes)
    ring = 2 * (n - 1) / n
    compressed = elem * sum(min((s[0] + math.prod(s[1:])) * RANK, math.prod(s))
                            if len(s) == 2 else math.prod(s) for s in shapes)
    return {"grad": grad, "ddp_s": ring * grad / link_bytes_per_s, "compressed": compressed,
            "powersgd_s": ring * compressed / link_bytes_per_s,
            "diloco_s": ring * grad / link_bytes_per_s / H}


def _plan(link):
    # a slow device (1 GFLOP/s), so that a fast link leaves the step compute-bound
    return px.plan(model=build(), gpus=GPUS, nodes=WORLD_NODES, precision="fp32", link=link,
                   powersgd_rank=RANK, sync_every=H, peak_tflops=1e-3)


def test_bytes_and_times_over_the_link_equal_the_hand_computed():
    want = _expected(1e9 / 8)
    got = _plan("1Gbit")
    report = got.link
    assert got["ddp"].comm_bytes_per_step == pytest.approx(want["ddp_s"] * 1e9 / 8)
    assert report.comm_s["ddp"] == pytest.approx(want["ddp_s"])
    assert report.ddp_grad_bytes == want["grad"]
    assert report.powersgd_grad_bytes == want["compressed"] < want["grad"]
    assert report.powersgd_comm_s == pytest.approx(want["powersgd_s"])
    assert report.diloco_comm_s == pytest.approx(want["diloco_s"])
    for name, plan in got.strategies.items():  # every strategy: its own bytes over the link
        assert report.comm_s[name] == pytest.approx(plan.comm_bytes_per_step / (1e9 / 8))
    # the link is the inter-node bandwidth of the rest of the plan too
    assert got.setting["inter_node_GBps"] == pytest.approx(1 / 8)


def test_verdict_follows_communication_against_compute():
    slow, fast = _plan("100Mbit"), _plan("400GB/s")
    compute = slow["ddp"].compute_time_s
    assert slow.link.comm_s["ddp"] > compute  # derived: 100 Mbit/s is far slower than compute
    assert slow.link.verdicts["ddp"].startswith("communication-bound: ")
    assert fast.link.comm_s["ddp"] < compute
    assert fast.link.verdicts["ddp"].startswith("compute-bound: ")


def test_cli_prints_the_verdict_and_the_what_ifs(capsys):
    spec = f"{__file__}:build"
    argv = ["plan", "--model", spec, "--gpus", str(GPUS), "--nodes", str(WORLD_NODES),
            "--precision", "fp32", "--strategy", "ddp", "--link", "100Mbit",
            "--powersgd-rank", str(RANK), "--sync-every", str(H)]
    assert phalanx_main(argv) == 0
    out = capsys.readouterr().out
    want = _expected(100e6 / 8)
    assert "over the link (0.1 Gbit/s = 0.0125 GB/s between nodes):" in out
    assert "ddp: communication-bound:" in out
    shrink = want["grad"] / want["compressed"]
    assert f"with PowerSGD rank {RANK} (ddp):" in out and f"({shrink:.1f}x fewer" in out
    assert f"with DiLoCo sync_every={H} (ddp):" in out
    assert phalanx_main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["link"]["diloco_comm_s"] == pytest.approx(want["diloco_s"])
    assert data["link"]["powersgd_grad_bytes"] == want["compressed"]


def test_cli_refuses_a_bad_link_and_a_single_node(capsys):
    base = ["plan", "--params", "125M", "--gpus", "1"]
    assert phalanx_main(base + ["--nodes", "2", "--link", "1Gb"]) != 0
    assert "ambiguous" in capsys.readouterr().err
    assert phalanx_main(base + ["--link", "1Gbit"]) != 0
    assert "--nodes 2" in capsys.readouterr().err
    assert phalanx_main(base + ["--nodes", "2", "--link", "1Gbit", "--sync-every", "0"]) != 0
    assert "sync_every" in capsys.readouterr().err
