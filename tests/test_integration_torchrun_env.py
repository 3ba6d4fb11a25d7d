"""A job whose processes are started by something else than phalanx, with the torchrun-style
variables in their environment: Kubeflow's PyTorchJob starts one `python train.py` per pod with
MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (no LOCAL_RANK); torchrun itself adds
LOCAL_RANK. Here two plain `python` processes get exactly those variables, set by hand:
`px.init()` adopts them (rank, world size, local rank 0), and zero3 training on the two ends
where one process on the whole batch ends, in float64.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import phalanx as px

    px.init()
    seen = {"rank": px.rank(), "world": px.world_size(), "local_rank": px.local_rank()}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3)).double()
    model, optimizer = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=0.9), strategy="zero3")
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randn(8, 6, generator=g).double(), torch.randn(8, 3, generator=g).double()
        rows = slice(4 * px.rank(), 4 * px.rank() + 4)
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    seen["weights"] = {k: v.tolist() for k, v in model.state_dict().items()}
    print("RESULT " + json.dumps(seen), flush=True)
    px.shutdown()
''')


def _reference() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 6, generator=g).double(), torch.randn(8, 3, generator=g).double()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pytorchjob_environment_is_adopted(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
    # what the training operator sets in each pod (docs/guides/launching.md#kubernetes)
    job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "PYTHONUNBUFFERED": "0"}
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path,
                              env={**base, **job, "RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank}:\n{out[-3000:]}"
        line = next(l for l in out.splitlines() if l.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    reference = _reference()
    for rank, seen in enumerate(results):
        assert (seen["rank"], seen["world"], seen["local_rank"]) == (rank, 2, 0)
        for name, value in reference.items():
            got = torch.tensor(seen["weights"][name], dtype=torch.float64)
            assert float((got - value).abs().max()) < 1e-12, (rank, name)
