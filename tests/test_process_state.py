"""px.shutdown() leaves the process as a new one has it: every part of the process state
(phalanx/process.py) fresh, after a job that used each of them, and a second px.init then runs
a second job exactly as the first ran.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from small_mlp import ROWS, batch, mlp, rank_rows

import phalanx as px
from phalanx.testing import run_ranks


def _parts_in_use() -> list[str]:
    """The parts of the process state that differ from a new process's."""
    from phalanx.world import process

    fresh = process.ProcessState()
    return [f.name for f in dataclasses.fields(fresh)
            if getattr(process.state, f.name) != getattr(fresh, f.name)]


def _one_job(path: str):
    """Prepare, take a step (its loss by px.global_mean), save in the background and log:
    what each part of the process state is for. Returns the weights after the step and the
    count tensor, which global_mean's totals hold weakly."""
    model = mlp(0)
    model, opt = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            strategy="zero2")
    x, y = rank_rows(*batch(0, ROWS * px.world_size()))
    count = torch.tensor(float(y.numel()))
    loss = px.global_mean(((model(x) - y) ** 2).sum(), count)
    loss.backward()
    opt.step()
    opt.zero_grad()
    px.save(path, model=model, optimizer=opt, background=True)
    px.log({"loss": loss.item()}, step=1)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, count


def _two_jobs(path):
    first, count = _one_job(os.path.join(path, "first"))
    in_use = _parts_in_use()
    rank = px.rank()
    px.shutdown()
    after_first = _parts_in_use()
    # The second job on a group of its own, over a new store, as a launcher's next job has: over
    # the old store, torch's name for a group made again (from its ranks and the number of live
    # groups) would be the old one's, whose keys (a dead address) are still there.
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{path}/second-job", rank=rank,
                            world_size=2)
    px.init()  # a second job in the same process
    second, _ = _one_job(os.path.join(path, "second"))
    loaded = mlp(1)
    px.load(os.path.join(path, "first"), model=loaded)
    same = all(torch.equal(first[k], second[k]) and torch.equal(first[k], v)
               for k, v in loaded.state_dict().items())
    world = px.world_size()
    px.shutdown()
    del count
    return {"in_use": in_use, "after_first": after_first, "after_second": _parts_in_use(),
            "world": world, "same": same}


def test_shutdown_resets_the_process_state_and_a_second_init_runs_the_same_job(
        tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path / "run"))
    results = run_ranks(_two_jobs, 2, args=(str(tmp_path),), timeout=120)
    for r in results:  # the job used every part but continue mode's
        assert set(r["in_use"]) == {"world", "groups", "records", "host", "leaving", "metrics",
                                    "services", "saves", "staged", "loss_totals"}, r
        assert r["after_first"] == [] and r["after_second"] == [], r
        assert r["world"] == 2 and r["same"], r
    assert (tmp_path / "run" / "metrics.csv").read_text().count("loss") == 2
