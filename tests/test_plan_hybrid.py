"""`phalanx plan --nodes M --gpus-per-node G` and planner.compare_layouts: the flat layout
against shard_size=G, their bytes across nodes derived from the model's shapes."""

import pytest
import torch

from phalanx.cli import main as phalanx_main
from phalanx.planner import compare_layouts

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)

WIDTH, LAYERS = 512, 6
SHAPES = [(WIDTH, WIDTH), (WIDTH,)] * LAYERS


def model():
    return torch.nn.Sequential(*[m for _ in range(LAYERS)
                                 for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())])


def numel():
    n = 0
    for shape in SHAPES:
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


OPTIONS = dict(precision="fp32", optimizer="sgd", backend="nccl", input_shape=str(WIDTH),
               intra_node_bw="400", link="1Gbit")


@pytest.mark.parametrize("nodes,gpus", [(2, 2), (3, 4)])
def test_bytes_across_nodes_follow_the_shapes(nodes, gpus):
    got = compare_layouts(model(), nodes=nodes, gpus_per_node=gpus, **OPTIONS)
    grads = 4 * numel()  # fp32 gradient bytes of the whole model
    assert {(r.layout, r.strategy) for r in got.rows} == (
        {("flat", s) for s in ("ddp", "zero1", "zero2", "zero3")}
        | {("hybrid", s) for s in ("zero1", "zero2", "zero3")})
    # hybrid: across nodes, the replicas' average of each rank's reduced gradient: all of it
    # under zero1, its 1/G shard under zero2 and zero3; zero3's gathers stay in the node
    assert got.row("hybrid", "zero1").inter_node_bytes == grads
    for s in ("zero2", "zero3"):
        assert got.row("hybrid", s).inter_node_bytes == pytest.approx(grads / gpus, rel=1e-3)
    # flat: every collective's payload crosses (its ring goes through every node); ddp's
    # all-reduce is of the whole gradient, zero3 gathers the parameters too
    assert got.row("flat", "ddp").inter_node_bytes == pytest.approx(grads, rel=1e-3)
    assert got.row("flat", "zero3").inter_node_bytes > got.row("flat", "ddp").inter_node_bytes
    # memory: zero3's parameters over G ranks in place of nodes x G
    assert got.row("hybrid", "zero3").plan.params_bytes == pytest.approx(
        nodes * got.row("flat", "zero3").plan.params_bytes, rel=1e-2)
    # over 1 Gbit/s between nodes and 400 GB/s within, the hybrid zero3 step is the shorter
    assert got.row("hybrid", "zero3").plan.step_time_s < got.row("flat", "zero3").plan.step_time_s


def test_the_recommendation_is_the_shortest_step_that_fits():
    got = compare_layouts(model(), nodes=2, gpus_per_node=4, **OPTIONS)
    fitting = [r for r in got.rows if r.plan.fits_with_headroom]
    assert got.recommended is min(fitting, key=lambda r: r.plan.step_time_s)
    assert f"{got.recommended.layout} {got.recommended.strategy}" in got.reason
    tight = compare_layouts(model(), nodes=2, gpus_per_node=4, gpu_memory="1MB", **OPTIONS)
    assert tight.recommended is None and "none fits" in tight.reason


def test_the_command_prints_a_row_per_layout_and_strategy(capsys):
    code = phalanx_main(["plan", "--params", "1e9", "--nodes", "2", "--gpus-per-node", "4",
                         "--link", "1Gbit", "--precision", "fp32"])
    out = capsys.readouterr().out
    assert code == 0
    table = out[out.index("layouts on 2 nodes x 4 GPUs (hybrid: shard_size=4)"):]
    rows = [line.split()[:2] for line in table.splitlines()[2:] if not line.startswith("recom")]
    assert rows == [["flat", s] for s in ("ddp", "zero1", "zero2", "zero3")] + \
        [["hybrid", s] for s in ("zero1", "zero2", "zero3")]
    assert "recommended: " in table


@pytest.mark.parametrize("kwargs,match", [
    (dict(nodes=1, gpus_per_node=4), "2 or more nodes"),
    (dict(nodes=2, gpus_per_node=1), "2 or more nodes of 2 or more GPUs"),
    (dict(nodes=2, gpus_per_node=4, shard_size=2), "leave shard_size out"),
])
def test_bad_layouts_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compare_layouts(params=1e9, **kwargs)
