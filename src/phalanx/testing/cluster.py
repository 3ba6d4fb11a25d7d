"""A cluster of several nodes on one machine: network namespaces joined by shaped links.

    with Cluster(nodes=2, rate="1gbit") as cluster:
        done = cluster.launch(["train.py", "strategy=zero2"], nproc_per_node=1)

Each node is a network namespace of its own, with its own loopback (its ranks talk to one
another there, as on one machine) and one interface, `eth0`, plugged into a switch: a bridge in
a namespace of its own. Every link is shaped in both directions with `tc` (a token bucket at
`rate`; `delay_ms` adds netem's latency), so traffic between nodes pays for bandwidth and
latency as it would between machines. `launch` starts one `phalanx run --nnodes N --node-rank R
--master-addr <node 0>` per node inside its namespace, exactly as one would on a real cluster.

Addresses (10.213.0.x) exist only inside the namespaces made here, and everything made here is
removed when the cluster ends: on leaving the `with` block, whatever ended it (an error, Ctrl-C,
a timeout), at the interpreter's exit, and, when a cluster is started, what a process that died
before it could clean up left behind (the namespaces' names carry the pid that made them).
Making namespaces needs root and the `ip` and `tc` commands, and a delay needs the kernel's
netem: `unavailable()` (`unavailable(latency=True)`) says why they cannot be made here (tests
skip with that reason), and `start` refuses with it.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import time

__all__ = ["Cluster", "unavailable"]

_PREFIX = "pxc"
_SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable(latency: bool = False) -> str | None:
    """Why network namespaces cannot be made here, or None when they can; with `latency`, also
    why their links cannot be given a delay (netem, which some kernels are built without)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is not installed"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    try:
        if latency:
            tried = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev",
                                    "lo", "root", "netem", "delay", "1ms"],
                                   capture_output=True, text=True)
            if tried.returncode != 0:
                return (f"this kernel cannot delay a link: tc's netem qdisc failed "
                        f"({tried.stderr.strip()}); load it with 'modprobe sch_netem' (a kernel "
                        "built with CONFIG_NET_SCH_NETEM), or give no delay_ms")
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _remove_abandoned() -> None:
    """Namespaces left by a process of ours that died before it could remove them."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        found = re.fullmatch(rf"{_PREFIX}(\d+)-.*", name)
        if found is None:
            continue
        pid = int(found.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _ip("netns", "del", name, check=False)
        except PermissionError:
            pass


class Cluster:
    """`nodes` namespaces joined through a switch by links of `rate` (tc's units: "1gbit",
    "10gbit"; None: unshaped) and `delay_ms` of one-way latency (None: none)."""

    def __init__(self, nodes: int = 2, rate: str | None = "1gbit", delay_ms: float | None = None):
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: at least 1")
        self.nodes, self.rate, self.delay_ms = nodes, rate, delay_ms
        tag = f"{_PREFIX}{os.getpid()}-{id(self) % 10**6}"
        self.switch = f"{tag}-sw"
        self.names = [f"{tag}-n{i}" for i in range(nodes)]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []

    # -- making and removing ----------------------------------------------------------------
    def start(self) -> "Cluster":
        reason = unavailable(latency=bool(self.delay_ms))
        if reason is not None:
            raise RuntimeError(f"cannot make a cluster of namespaces here: {reason}")
        _remove_abandoned()
        atexit.register(self.stop)
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                self._add(name)
                _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name",
                    f"b{i}", "netns", self.switch)
                _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                for ns, dev in ((name, "lo"), (name, "eth0"), (self.switch, f"b{i}")):
                    _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", self.switch, "link", "set", f"b{i}", "master", "br0")
                self._shape(name, "eth0")           # out of the node
                self._shape(self.switch, f"b{i}")   # into the node
        except BaseException:
            self.stop()
            raise
        return self

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _shape(self, namespace: str, dev: str) -> None:
        tc = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", dev, "root"]
        if self.delay_ms:
            # netem's delay, and its rate when shaped (tbf cannot sit under netem's root)
            rate = ["rate", self.rate] if self.rate else []
            subprocess.run([*tc, "netem", "delay", f"{self.delay_ms}ms", *rate,
                            "limit", "100000"], check=True, capture_output=True)
        elif self.rate:
            subprocess.run([*tc, "tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms"],
                           check=True, capture_output=True)

    def stop(self) -> None:
        """End what runs in the cluster and remove every namespace made (their links go with
        them). Safe to call twice."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._procs = []
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)
        atexit.unregister(self.stop)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- using it -------------------------------------------------------------------------------
    def address(self, node: int) -> str:
        return f"{_SUBNET}.{node + 1}"

    def popen(self, node: int, argv: list[str], env: dict | None = None,
              **kwargs) -> subprocess.Popen:
        """Start `argv` on node `node` (inside its namespace). Gloo is told to use the node's
        interface (the machine's host name means nothing inside a namespace)."""
        full_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": "eth0"}
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[node], *argv], env=full_env,
                                **kwargs)
        self._procs.append(proc)
        return proc

    def launch(self, script_and_args: list[str], nproc_per_node: int = 1, port: int = 29500,
               env: dict | None = None, timeout: float = 300.0,
               cwd: str | None = None) -> list[subprocess.CompletedProcess]:
        """Run `phalanx run` on every node, as on a real cluster; wait for all of them (killing
        every node's launcher at `timeout`); their outputs by node rank."""
        procs = []
        for node in range(self.nodes):
            argv = [sys.executable, "-m", "phalanx", "run", "-n", str(nproc_per_node),
                    "--nnodes", str(self.nodes), "--node-rank", str(node),
                    "--master-addr", self.address(0), "--master-port", str(port),
                    *script_and_args]
            procs.append(self.popen(node, argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout
        done = []
        for node, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise TimeoutError(f"the cluster's job did not end within {timeout:.0f} s "
                                   f"(node {node} was still running)") from None
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return done

    def link_bytes(self, node: int) -> tuple[int, int]:
        """Bytes node `node` has sent and received on its link to the switch so far."""
        def read(what):
            path = f"/sys/class/net/eth0/statistics/{what}_bytes"
            out = subprocess.run(["ip", "netns", "exec", self.names[node], "cat", path],
                                 capture_output=True, text=True, check=True).stdout
            return int(out)
        return read("tx"), read("rx")
