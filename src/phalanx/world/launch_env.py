"""Where this process sits in the job, as its launcher described it.

`phalanx run` and `torchrun` set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
SLURM's `srun` sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_NODELIST (the first host
of the node list is the master); with none of them the world is one process.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["LaunchEnv", "read_launch_env", "check_slurm_tasks"]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    source: str  # "torchrun", "slurm" or "none"


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[03-05,07],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _int_env(env, name):
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def read_launch_env(env=None) -> LaunchEnv:
    """Read rank and world from torchrun/`phalanx run` variables, else SLURM's, else a world of
    one."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        port = env.get("MASTER_PORT")
        return LaunchEnv(
            rank=_int_env(env, "RANK"),
            world_size=_int_env(env, "WORLD_SIZE"),
            local_rank=_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(port) if port else None,
            source="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = env.get("SLURM_JOB_ID", "0")
        port = env.get("MASTER_PORT") or str(20000 + int(job) % 20000 if job.isdigit() else 29500)
        addr = env.get("MASTER_ADDR")
        if addr is None and env.get("SLURM_NODELIST"):
            addr = _first_slurm_host(env["SLURM_NODELIST"])
        return LaunchEnv(
            rank=_int_env(env, "SLURM_PROCID"),
            world_size=_int_env(env, "SLURM_NTASKS"),
            local_rank=_int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            master_addr=addr or "127.0.0.1",
            master_port=int(port),
            source="slurm",
        )
    return LaunchEnv(0, 1, 0, None, None, "none")


def check_slurm_tasks(env: LaunchEnv, environ=None) -> None:
    """A batch script that runs `python train.py` without `srun` starts one process where
    SLURM_NTASKS promises several, and that process would wait for peers that never come.
    srun sets SLURM_STEP_ID in every task it starts; the batch script's own shell has none."""
    environ = os.environ if environ is None else environ
    if env.source == "slurm" and env.world_size > 1 and "SLURM_STEP_ID" not in environ \
            and "SLURM_STEPID" not in environ:
        raise RuntimeError(
            f"SLURM_NTASKS={env.world_size} but this process was not started by srun (no "
            "SLURM_STEP_ID), so it would wait for peers that never start: in the sbatch "
            "script, run `srun python train.py` (one task per rank), or start one launcher per "
            "node with `srun --ntasks-per-node=1 phalanx run -n GPUS_PER_NODE --nnodes "
            "$SLURM_NNODES ... train.py`")
