"""The runtime reads launcher environments and runs as a world of one without any."""

import datetime
import subprocess
import sys

import pytest
import torch

import phalanx as px
from phalanx.comm import groups
from phalanx.world.launch_env import (
    LaunchEnv,
    _first_slurm_host,
    check_slurm_tasks,
    read_launch_env,
)


def test_torchrun_environment():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == \
        (3, 8, 1, "10.0.0.1", 1234)
    assert env.source == "torchrun"


def test_slurm_environment_takes_the_first_node_as_master():
    env = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                           "SLURM_NODELIST": "gpu[07-09,12],cpu1", "SLURM_JOB_ID": "4242"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 8, 1, "gpu07")
    assert env.source == "slurm"
    assert 20000 <= env.master_port < 40000


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("a[1-3]", "a1"),
                                             ("x[003,5]", "x003"), ("h1,h2", "h1")])
def test_slurm_node_lists(nodelist, first):
    assert _first_slurm_host(nodelist) == first


def test_sbatch_without_srun_is_explained():
    env = LaunchEnv(0, 4, 0, "node1", 29500, "slurm")
    with pytest.raises(RuntimeError, match="SLURM_NTASKS=4 but this process was not started by "
                                           "srun.*srun python train.py"):
        check_slurm_tasks(env, {"SLURM_NTASKS": "4", "SLURM_PROCID": "0"})
    check_slurm_tasks(env, {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
    check_slurm_tasks(LaunchEnv(0, 1, 0, None, None, "slurm"), {"SLURM_NTASKS": "1"})


def test_no_launcher_is_a_world_of_one():
    assert read_launch_env({}).world_size == 1


def test_bad_rank_variable_names_it():
    with pytest.raises(ValueError, match="RANK"):
        read_launch_env({"RANK": "zero", "WORLD_SIZE": "2"})


def test_plain_python_script_runs_as_one_process(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "import phalanx as px\npx.init()\n"
        "print('rank', px.rank(), 'of', px.world_size(), px.device(), px.is_main())\n"
        "px.barrier(); px.shutdown(); px.shutdown()\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rank 0 of 1 cpu True" in out.stdout


# Item 14 of the issue "Defects found by running real training code": init's options checked.
@pytest.mark.parametrize("timeout,error,words", [
    (0, ValueError, "positive, finite number of seconds"),
    (-5, ValueError, "positive, finite number of seconds"),
    (float("inf"), ValueError, "positive, finite number of seconds"),
    (float("nan"), ValueError, "positive, finite number of seconds"),
    ("20", TypeError, "takes a number of seconds"),
    (True, TypeError, "takes a number of seconds"),
])
def test_init_names_a_bad_timeout(timeout, error, words):
    px.shutdown()  # whatever an earlier test joined
    with pytest.raises(error, match=r"px\.init\(timeout=") as caught:
        px.init(timeout=timeout)
    assert words in str(caught.value)
    assert not px.world.process.state.world.initialized  # the check comes before anything is joined


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_init_nccl_without_a_gpu_says_so():
    with pytest.raises(ValueError, match="NCCL needs CUDA GPUs.*backend='gloo'"):
        px.init(backend="nccl")
    with pytest.raises(TypeError, match="takes a name such as 'gloo'"):
        px.init(backend=3)


@pytest.mark.parametrize("timeout", [30, 2.5, datetime.timedelta(minutes=1)])
def test_init_takes_seconds_or_a_timedelta(timeout):
    px.shutdown()  # whatever an earlier test joined: init would not look at its timeout
    px.init(timeout=timeout)
    try:
        assert px.world_size() == 1
        # the job's timeout, which bounds every group phalanx makes (groups.py), as a timedelta
        want = timeout if isinstance(timeout, datetime.timedelta) else \
            datetime.timedelta(seconds=timeout)
        assert groups.timeout() == want
    finally:
        px.shutdown()
