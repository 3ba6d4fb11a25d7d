"""A cluster of nodes on one machine (phalanx.testing.cluster): a multi-node job through
`phalanx run --nnodes`, one launcher per node in its own network namespace, as on a real
cluster; and nothing left behind. Skipped, with the reason, where namespaces cannot be made
(not root, no iproute2)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx.testing.cluster import Cluster, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))

NANOGPT = Path(__file__).parent / "launch_scripts" / "nanogpt.py"


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              check=True).stdout.split())


def test_a_two_node_job_through_phalanx_run_trains_as_one_process(tmp_path):
    one = tmp_path / "one.pt"
    done = subprocess.run([sys.executable, str(NANOGPT), "strategy=torchddp", f"result={one}",
                           f"out_dir={tmp_path / 'one'}"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    two = tmp_path / "two.pt"
    with Cluster(nodes=2, rate="10gbit") as cluster:
        before = cluster.link_bytes(1)
        nodes = cluster.launch([str(NANOGPT), "strategy=zero2", f"result={two}",
                                f"out_dir={tmp_path / 'two'}"], nproc_per_node=2, timeout=300)
        sent, received = (a - b for a, b in zip(cluster.link_bytes(1), before))
        names = set(cluster.names + [cluster.switch])
        assert names <= _namespaces()
    for node, done in enumerate(nodes):
        assert done.returncode == 0, f"node {node}: {done.stderr[-3000:]}"
    # 4 ranks in all: node 1's two ranks exchanged gradients with node 0 over its link
    assert sent > 100_000 and received > 100_000, (sent, received)
    want, got = torch.load(one), torch.load(two)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        diff = ((got[key] - value).abs().max() / value.abs().max().clamp_min(1e-30)).item()
        assert diff <= 1e-10, f"{key} differs by {diff:.3g} (relative)"
    assert not names & _namespaces(), "namespaces left behind"


def test_nothing_is_left_behind_when_the_job_fails():
    cluster = Cluster(nodes=2, rate=None)
    with pytest.raises(RuntimeError, match="inside"):
        with cluster:
            names = set(cluster.names + [cluster.switch])
            assert names <= _namespaces()
            sleeper = cluster.popen(0, ["sleep", "30"])
            raise RuntimeError("a failure inside the block")
    assert not names & _namespaces(), "namespaces left behind"
    assert sleeper.poll() is not None, "a process started in the cluster outlived it"
