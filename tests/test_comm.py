"""One way to the wire: every collective goes through a `Comm`, which records it."""

import pathlib
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.comm.collectives import Comm
from phalanx.testing import run_ranks
from phalanx.world import runtime

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "phalanx"


@pytest.mark.one_process
def test_no_collective_bypasses_the_comm():
    """Only collectives.py calls torch.distributed's collectives. One exception, on purpose: the
    shard service's point-to-point sends (engine/remote.py): two ranks only, outside any
    sequence every rank issues, so not a Comm's collective; bounded by its group's timeout and
    the store's, and named in PeerError when a peer does not answer."""
    pattern = re.compile(r"\bdist\.(all_reduce|all_gather|reduce_scatter|broadcast|barrier|"
                         r"gather|scatter|send|recv|all_to_all)")
    offenders = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py")
                 if path.name not in ("collectives.py", "remote.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if pattern.search(line)]
    assert offenders == []


def _records(prefer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = Comm(runtime.default_group(), prefer=prefer)
    model, opt = px.prepare(model, opt, strategy="zero2", bucket_mb=0.0005, comm=comm)
    for _ in range(2):
        F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
        opt.step()
        opt.zero_grad()
    return [(r.seq, r.kind, r.nbytes, r.tag, r.started, r.completed) for r in comm.records]


def test_every_engine_collective_is_recorded_with_its_completion():
    for prefer, reduce_kind in (("all_reduce", "all_reduce"), ("reduce_scatter", "reduce_scatter")):
        for records in run_ranks(_records, 2, args=(prefer,), timeout=60):
            seqs = [r[0] for r in records]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            grads = [r for r in records if r[3] and r[3].endswith(":grads")]
            unshards = [r for r in records if r[3] and r[3].endswith(":unshard")]
            assert grads and unshards
            assert {r[1] for r in grads} == {reduce_kind}
            assert {r[1] for r in unshards} == {"all_gather"}
            for _seq, kind, nbytes, tag, started, completed in records:
                assert nbytes >= 0 and started > 0
                # completion comes from the work's future, not from a wait in the recorder
                assert completed is not None and completed >= started, (kind, tag)
