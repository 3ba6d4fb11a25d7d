"""Start N copies of a training script per node, through PyTorch's elastic agent.

One machine, four workers:

    phalanx run -n 4 train.py --lr 0.1
    phalanx run -n 4 -m mypackage.train --lr 0.1

Two machines with eight workers each (the same command on both, only --node-rank differs):

    phalanx run --nnodes 2 --node-rank 0 -n 8 --master-addr 10.0.0.1 --master-port 29500 train.py
    phalanx run --nnodes 2 --node-rank 1 -n 8 --master-addr 10.0.0.1 --master-port 29500 train.py

Each worker finds RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment
(the variables torchrun sets), so `px.init()` joins the job; the script runs unchanged under
plain `python` as a world of one. Global ranks are numbered node by node: node R holds ranks
R*N .. R*N+N-1. Every line a worker prints is prefixed with its global rank ("[rank3]: ...").
Workers get OMP_NUM_THREADS=1 when there are several per node, unless it is already set.

On one machine a free port is chosen, so several jobs can share the machine. With --nnodes > 1,
node 0 hosts the rendezvous at --master-addr:--master-port (default 127.0.0.1:29500) and each
node waits at most --join-timeout seconds for the others.

When a worker fails, the workers on its node are stopped and the command exits with status 1
after one message naming the first rank that failed, its exit code or signal, and the end of
its traceback (for a native crash, the line that names its cause). With --max-restarts K the
node's workers are first restarted up to K times, each restart announced by one line naming
the rank that failed and how; the final message lists the earlier attempts.
A mistake in the command itself (no such script, -n 0, no master) is one line and exit
status 2. The elastic agent's own log lines are hidden unless --verbose.
"""

# The package, by role:
#   cli.py         the flags, their checks, and `main`: one job from command line to exit status
#   agent.py       the elastic agent that runs this node's workers and announces restarts
#   rendezvous.py  torch's static rendezvous, with a fresh workers' store per attempt
#   failures.py    turning failed workers into the one message the user reads
#   worker.py      the worker's entry point: runs the user's script, records its failure
#   spawn.py       `px.spawn`: workers of a function rather than a script, without the agent
#                  (from a notebook too); the test harness (phalanx.testing) is built on it

from .cli import add_arguments, main

__all__ = ["add_arguments", "main"]
