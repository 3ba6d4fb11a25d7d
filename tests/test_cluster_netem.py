"""A cluster whose links are given a delay on a kernel without netem: refused before anything is
made, with the reason and the fix, not tc's bare "Specified qdisc kind is unknown"
(phalanx.testing.cluster). Skipped where namespaces cannot be made at all."""

import subprocess

import pytest

from phalanx.testing.cluster import Cluster, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              check=True).stdout.split())


def test_a_delay_is_refused_clearly_where_the_kernel_has_no_netem():
    # the kernel decides: netem is tried on a link of its own here, as unavailable() tries it
    probe = "pxc-netem-test"
    subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True)
    try:
        tried = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo",
                                "root", "netem", "delay", "1ms"], capture_output=True, text=True)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    reason = unavailable(latency=True)
    if tried.returncode == 0:
        assert reason is None
        with Cluster(nodes=1, rate=None, delay_ms=1):
            pass
        return
    assert reason is not None and "netem" in reason and "modprobe sch_netem" in reason
    assert tried.stderr.strip() in reason  # tc's own words kept, after the explanation
    before = _namespaces()
    cluster = Cluster(nodes=1, rate="1gbit", delay_ms=20)
    with pytest.raises(RuntimeError, match="cannot delay a link.*netem"):
        cluster.start()
    assert _namespaces() == before  # nothing made, nothing left
    with Cluster(nodes=1, rate="1gbit"):  # without a delay it is made as before
        pass
