"""What a worker leaves behind when it ends: files flushed, groups ended, torch's functions
put back."""

from __future__ import annotations

import os
import sys
import types

import torch.distributed as dist

import phalanx as px
from phalanx.comm import groups
from phalanx.launch.spawn import run_workers
from phalanx.testing import engine_of


def _log_without_close(run_dir):
    """Log through a stand-in TensorBoard writer that notes its close() in a file; never call
    close or px.shutdown: the worker's exit (os._exit after the run) must close it."""
    os.environ["PHALANX_RUN_DIR"] = run_dir

    class Writer:
        def __init__(self, logdir):
            self.logdir = logdir

        def add_scalar(self, *args):
            pass

        def close(self):
            with open(os.path.join(run_dir, f"closed.{px.rank()}"), "w") as f:
                f.write("events flushed\n")

    stub = types.ModuleType("torch.utils.tensorboard")
    stub.SummaryWriter = Writer
    sys.modules["torch.utils.tensorboard"] = stub
    px.log({"loss": 1.0}, step=0)


def test_tensorboard_events_are_flushed_when_a_worker_exits(tmp_path):
    run_workers(_log_without_close, 2, (str(tmp_path),), rendezvous="file", timeout=60)
    assert os.path.exists(tmp_path / "closed.0"), os.listdir(tmp_path)  # rank 0 writes logs


def _groups_after_shutdown():
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = px.prepare(model, opt, strategy="zero3")  # px.init() ran: timeout 600 s
    made = groups.made()
    timeouts = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for g in made]
    service = engine_of(model).remote  # its channel lies outside torch's registry
    timeouts.append(service.channel.options._timeout.total_seconds())
    # routed to px.shutdown while the group lives, torch's own again after (leaving.py)
    routed = [dist.destroy_process_group.__module__]
    px.shutdown()
    routed.append(dist.destroy_process_group.__module__)
    return timeouts, len(groups.made()), dist.is_initialized(), service.channel is None, routed


def test_the_groups_phalanx_made_are_bounded_by_the_jobs_timeout_and_end_at_shutdown():
    """zero3's gathers group had torch's default timeout (30 min on gloo) and outlived
    px.shutdown."""
    for timeouts, left, initialized, channel_ended, routed in run_workers(
            _groups_after_shutdown, 2, rendezvous="tcp", timeout=60, shutdown=False):
        # zero3's gathers and the shard service's channel (engine/remote.py); torch's
        # default: 1800
        assert timeouts == [600.0, 600.0] and left == 0 and not initialized and channel_ended
        assert routed == ["phalanx.world.leaving", "torch.distributed.distributed_c10d"]
