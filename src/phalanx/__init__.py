"""phalanx: data-parallel training for PyTorch.

    import phalanx as px
    px.init()
    model, optimizer = px.prepare(model, optimizer, strategy="ddp")

The public names are those of the user contract; everything else lives in private modules.
"""

from .checkpoint import CheckpointError, export, latest_checkpoint, load, save
from .comm import continuation as _continuation
from .comm.collectives import JobEnded
from .continuing import session as _continuing_session
from .data import (
                      DistributedSampler,
                      data_loader,
                      gather,
                      gather_for_metrics,
                      global_mean,
                      map_batches,
)
from .engine.chained import chain_optimizers
from .engine.optimizer_kinds import element_wise, matrix_wise
from .engine.powersgd_config import PowerSGD
from .engine.remote import PeerError
from .engine.vote import StepFailed
from .faults.nonfinite import NonFiniteError
from .faults.replica_check import ReplicasDiffer
from .launch.spawn import SpawnError, spawn
from .model.diloco import DiLoCo
from .model.linear_loss import linear_cross_entropy
from .model.prepare import (
                      clip_grad_norm_,
                      no_sync,
                      optimizer_state_dict,
                      prepare,
                      step_stats,
                      unwrap,
)
from .model.pretrained import from_safetensors
from .observe.metrics import log, progress
from .planner import plan
from .world.runtime import barrier, device, init, is_main, local_rank, rank, shutdown, world_size

_continuation.install(_continuing_session.start)  # px.init's way to continue mode (continuing/)

__version__ = "0.1.0"

__all__ = [
    "init", "rank", "world_size", "local_rank", "device", "is_main", "barrier", "shutdown",
    "prepare", "no_sync", "clip_grad_norm_", "unwrap", "optimizer_state_dict", "step_stats",
    "DiLoCo", "from_safetensors",
    "PowerSGD", "element_wise", "matrix_wise", "chain_optimizers",
    "DistributedSampler", "data_loader", "gather", "gather_for_metrics", "map_batches",
    "global_mean", "linear_cross_entropy",
    "plan",
    "save", "load", "latest_checkpoint", "export",
    "spawn",
    "log", "progress",
    "CheckpointError", "SpawnError", "ReplicasDiffer", "NonFiniteError", "PeerError",  # to catch
    "JobEnded", "StepFailed",
]
