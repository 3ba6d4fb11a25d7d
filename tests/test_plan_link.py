"""`phalanx plan --link` and `px.plan(link=...)`: the link parsed in bits or bytes with its
latency, each strategy's communication time over it with a verdict, the PowerSGD and DiLoCo
what-ifs and the streaming DiLoCo setting, against figures computed here from the model's own
shapes and the bytes DiLoCo's wire hands its all-gather (planner/link.py, planner/streaming.py)."""

import json
import math

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.cli import main as phalanx_main
from phalanx.engine.diloco import fragment_of
from phalanx.engine.diloco_wire import Wire
from phalanx.planner.link import link_latency, parse_link

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)

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


@pytest.mark.parametrize("text,bytes_per_s,seconds", [
    ("100Mbit+20ms", 100e6 / 8, 0.02), ("1Gbit + 500us", 1e9 / 8, 5e-4),
    ("25GB/s+0.1s", 25e9, 0.1), ("1Gbit", 1e9 / 8, 0.0)])
def test_link_with_its_latency(text, bytes_per_s, seconds):
    assert parse_link(text) == pytest.approx(bytes_per_s)
    assert link_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1Gb", "1gb", "1", "fast", "0Gbit", "-1Gbit", "1Xbit", "",
                                  "1Gbit+20", "1Gbit+", "1Gb+20ms"])
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
            "--precision", "fp32", "--strategy", "ddp", "--link", "100Mbit+20ms",
            "--powersgd-rank", str(RANK), "--sync-every", str(H), "--peak-tflops", "1e-3"]
    assert phalanx_main(argv) == 0
    out = capsys.readouterr().out
    want = _expected(100e6 / 8)
    streaming = _plan("100Mbit+20ms").link.streaming
    P, D = streaming.fragments, streaming.delay
    assert "over the link (0.1 Gbit/s = 0.0125 GB/s, 20.0 ms latency between nodes):" in out
    assert "ddp: communication-bound:" in out
    shrink = want["grad"] / want["compressed"]
    assert f"with PowerSGD rank {RANK} (ddp):" in out and f"({shrink:.1f}x fewer" in out
    assert f"with DiLoCo sync_every={H} (ddp):" in out
    assert (f"with streaming DiLoCo sync_every={H}, fragments={P}, delay={D}, int4: "
            f"{streaming.fragment_bytes / 1e6:.3g} MB from each rank per fragment every "
            f"{H // P} steps") in out
    assert f'px.DiLoCo(sync_every={H}, fragments={P}, delay={D}, comm_dtype="int4")' in out
    assert phalanx_main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["link"]["latency_s"] == pytest.approx(0.02)
    assert data["link"]["streaming"]["fragments"] == P and data["link"]["streaming"]["delay"] == D
    assert data["link"]["streaming"]["fragment_bytes"] == streaming.fragment_bytes
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


# -- streaming DiLoCo ([Note: planning streaming DiLoCo] in planner/streaming.py) ---------------

class _Recorder:
    """A Comm of `world` ranks that keeps the bytes each all-gather is handed (never waited)."""

    def __init__(self, world):
        self.world, self.sent = world, []

    def all_gather_into(self, out, payload, async_op=False, tag=None):
        self.sent.append(payload.numel() * payload.element_size())
        return None


def _wire_bytes(sizes, dtype):
    """What engine/diloco_wire.py sends from one rank for int4 pseudo-gradients of `sizes`."""
    comm = _Recorder(WORLD_NODES * GPUS)
    Wire(comm, torch.int4, error_feedback=True).start(
        list(range(len(sizes))), [torch.randn(n, dtype=dtype) for n in sizes], "test")
    return sum(comm.sent)


def _exchange(sizes, parts, dtype, link):
    """Seconds of the largest fragment's all-gather over `link`: N-1 hops of a payload each."""
    sent = max(_wire_bytes([sizes[i] for i in f], dtype) for f in fragment_of(sizes, parts))
    hops = WORLD_NODES * GPUS - 1
    return sent, hops * (sent / parse_link(link) + link_latency(link))


@pytest.mark.parametrize("link", ["100Mbit+20ms", "1Gbit", "400GB/s"])
@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32),
                                             ("bf16-true", torch.bfloat16)])
def test_streaming_setting_hides_the_exchange_with_the_fewest_steps_late(link, precision, dtype):
    got = px.plan(model=build(), gpus=GPUS, nodes=WORLD_NODES, precision=precision, link=link,
                  sync_every=H, peak_tflops=1e-3)
    plan = got.link.streaming
    compute = got["ddp"].compute_time_s
    sizes = [p.numel() for p in build().parameters()]
    P, D = plan.fragments, plan.delay
    sent, seconds = _exchange(sizes, P, dtype, link)
    assert plan.fragment_bytes == sent and plan.exchange_s == pytest.approx(seconds)
    assert D == max(1, math.ceil(seconds / compute)) and D < H // P
    px.DiLoCo(sync_every=H, fragments=P, delay=D, comm_dtype="int4")  # a setting it accepts
    # no other number of fragments hides it with fewer steps late, or as few with fewer fragments
    for parts in (p for p in range(1, len(sizes) + 1) if H % p == 0):
        late = max(1, math.ceil(_exchange(sizes, parts, dtype, link)[1] / compute))
        if late < H // parts:
            assert (late, parts) >= (D, P)


def test_streaming_from_a_bare_count_cuts_it_in_equal_parts():
    count = sum(p.numel() for p in build().parameters())
    got = px.plan(params=count, gpus=GPUS, nodes=WORLD_NODES, precision="fp32",
                  link="100Mbit+20ms", sync_every=H, peak_tflops=1e-3)
    plan = got.link.streaming
    assert plan.fragments is not None
    assert plan.fragment_bytes == _wire_bytes([-(-count // plan.fragments)], torch.float32)


def test_streaming_says_when_nothing_hides_the_exchange_and_what_would():
    link, short = "100Mbit+20ms", 4
    got = px.plan(model=build(), gpus=GPUS, nodes=WORLD_NODES, precision="fp32", link=link,
                  sync_every=short, peak_tflops=1e-3)
    plan = got.link.streaming
    compute = got["ddp"].compute_time_s
    sizes = [p.numel() for p in build().parameters()]
    for parts in (1, 2, 4):  # derived: every fragment's exchange outlasts its window
        assert math.ceil(_exchange(sizes, parts, torch.float32, link)[1] / compute) \
            >= short // parts
    assert plan.fragments is None and plan.delay is None
    assert plan.fragment_bytes == _wire_bytes(sizes, torch.float32)  # the whole model's
    line = plan.line()
    assert "no setting hides the exchange" in line
    assert f"raise --sync-every to {plan.needs_sync_every} or more" in line
    assert plan.needs_sync_every > short
    enough = px.plan(model=build(), gpus=GPUS, nodes=WORLD_NODES, precision="fp32", link=link,
                     sync_every=plan.needs_sync_every, peak_tflops=1e-3)
    assert enough.link.streaming.fragments is not None
