"""`phalanx run`: start N copies of a training script per node, through PyTorch's elastic agent.

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
its traceback (for a native crash, the line that names its cause); or, when the others failed
waiting for it, the rank that hung (its process frozen, or still there 30 s after SIGTERM:
the launcher ended it) or left early (its script ended while the others went on), followed by
what the first of them said. With --max-restarts K the
node's workers are first restarted up to K times, each restart announced by one line naming
the rank that failed and how; the final message lists the earlier attempts.
With --on-failure continue a failed worker does not stop the others: they form a group
without it and redo the step in flight (each change is one line, from the new rank 0), and
the agent starts a replacement for it (while --max-restarts allows), which joins at the
others' next px.save and goes on from their live state (phalanx/continuing/). With
--on-failure stop the first failure ends the job, whatever --max-restarts says.
A mistake in the command itself is one line and exit status 2, before any worker starts: no
such script, -n 0 or more workers than the machine holds (at most 4 a CPU core, and what the
available memory holds at about 240 MiB a worker; --oversubscribe starts them anyway), a
--log-dir that cannot be written, an unknown --master-addr, no master, or a PHALANX_*
variable set to a value it does not take. The elastic agent's own log lines are hidden unless
--verbose. Without --log-dir the workers' logs are kept in a temporary directory that the
launcher removes at its end; one that a killed launcher left is removed by the next
`phalanx run` on the machine, never one whose launcher still runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import socket
import sys
import time

from phalanx.launch import scratch
from phalanx.world import environment
from phalanx.world.environment import why_not_writable_dir

__all__ = ["add_arguments", "main", "check_arguments"]

# A command that names no script; every `phalanx run` mistake message ends with what to type.
_NEEDS_SCRIPT = ("a script to run is needed after the options, for example "
                 "`phalanx run -n 2 train.py --lr 0.1` or `phalanx run -n 2 -m mypackage.train`")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc-per-node", type=_workers, required=True, metavar="N",
                        help="workers to start on this node, or 'auto': one per GPU, or one "
                             "per two CPU cores on a machine without one")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M",
                        help="number of nodes in the job (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R",
                        help="this node's index, 0 .. M-1; node 0 hosts the rendezvous (default 0)")
    parser.add_argument("--master-addr", default="127.0.0.1", metavar="A",
                        help="address of node 0, reachable from every node (default 127.0.0.1)")
    parser.add_argument("--master-port", type=int, default=None, metavar="P",
                        help="port of the rendezvous on node 0 (default: a free port on one "
                             "node, 29500 with --nnodes > 1)")
    parser.add_argument("--join-timeout", type=int, default=30, metavar="S",
                        help="seconds a node waits for the master and the other nodes before "
                             "giving up (default 30)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart this node's workers up to K times after a failure (default "
                             "0); with --on-failure continue, start up to K replacements")
    parser.add_argument("--on-failure", choices=("restart", "continue", "stop"),
                        default="restart",
                        help="what a worker's failure does: 'restart' every worker of the node "
                             "(up to --max-restarts times; the default), 'continue' with the "
                             "others and replace only the failed one, or 'stop' the job")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="keep each worker's stdout, stderr and error file under DIR "
                             "(default: a temporary directory, removed at the end)")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="start -n workers even past what this machine holds (by default "
                             "at most 4 a CPU core, and what the available memory holds at "
                             "about 240 MiB each)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the elastic agent's own log messages")
    parser.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name, run as `python -m SCRIPT`")
    # Optional for argparse, so that a missing script is our one-line message with an example
    # (check_arguments) rather than argparse's "the following arguments are required: ARGS".
    parser.add_argument("script", metavar="SCRIPT", nargs="?",
                        help="the training script (a path, or a module name with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments passed to every worker's script")


def _workers(value: str) -> int:
    """-n: a number, or "auto" (see phalanx.world.runtime.auto_processes for why)."""
    if value == "auto":
        from phalanx.world.runtime import auto_processes

        return auto_processes()
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {value!r}") from None


def main(args: argparse.Namespace) -> int:
    from phalanx.spec.command_error import CommandError

    check_arguments(args)
    port = args.master_port
    if port is None:  # one node: port 0 lets the store pick a free port itself
        port = 0 if args.nnodes == 1 else 29500

    # Imported here: `phalanx --help` and the workers need none of the agent.
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from . import agent, failures

    _configure_agent_logging(args.verbose)
    if args.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the agent passes it on to workers
    os.environ["PHALANX_ON_FAILURE"] = args.on_failure  # px.init reads it (phalanx/continuing/)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # workers' lines appear as they come
    # One run directory for every worker's px.log and trace files (observe/metrics.py), and the
    # same after a restart; none where the working directory is read-only (then a script that
    # calls px.log is told so, and one that does not runs).
    from phalanx.observe.metrics import default_run_dir

    if environment.value("PHALANX_RUN_DIR") is None and why_not_writable_dir("runs") is None:
        os.environ["PHALANX_RUN_DIR"] = default_run_dir()
    os.environ.pop("PHALANX_JOINING", None)  # set for a replacement only (continuing.py)
    # Workers' output reaches the console line by line through the agent's log files, where a
    # progress bar (redrawn with carriage returns) would come out as one long line at the
    # end: px.progress on rank 0 draws on the terminal the launcher was started from instead.
    try:
        if sys.stderr.isatty():
            os.environ.setdefault("PHALANX_TTY", os.ttyname(sys.stderr.fileno()))
    except (OSError, AttributeError, ValueError):
        pass

    if args.node_rank > 0 and not _wait_for_master(args.master_addr, port, args.join_timeout):
        raise CommandError(f"no master at {args.master_addr}:{port} after {args.join_timeout} s; "
                           "start node 0 with the same --master-addr and --master-port, or "
                           "raise --join-timeout")
    # See [Note: a launcher's temporary directory] in scratch.py
    log_dir, lock = (args.log_dir, None) if args.log_dir else scratch.make("phalanx-run-")

    def announce_restart(attempt: int, failed: dict, endings: dict) -> str:
        line = failures.restart_line(failed, log_dir, attempt, args.max_restarts + 1, endings)
        print(line, file=sys.stderr, flush=True)
        return failures.attempt_summary(failed, log_dir, endings)

    def note_survived(rank: int, failure, ending=None) -> str:  # --on-failure continue
        return failures.attempt_summary({rank: failure}, log_dir,
                                        None if ending is None else {rank: ending})

    worker_args = ["-u", "-m", "phalanx.launch.worker"]  # see worker.py
    worker_args += (["-m"] if args.module else []) + [args.script] + list(args.script_args)
    try:
        result, earlier, endings = agent.run_agent(args, port, log_dir, worker_args,
                                                   announce_restart, note_survived)
        if result.is_failed():
            print(failures.failure_report(result.failures, log_dir, earlier, endings,
                                          survived=args.on_failure == "continue"),
                  file=sys.stderr)
            return 1
        if earlier and args.on_failure == "continue":
            print(failures.survived_line(earlier), file=sys.stderr)
    except SignalException as exc:
        print(f"phalanx run: stopped by {exc.sigval.name}; the workers were stopped",
              file=sys.stderr)
        return 128 + int(exc.sigval)
    except DistError as exc:
        raise CommandError(_rendezvous_error(args, port, exc)) from None
    finally:
        if args.log_dir is None:
            scratch.remove(log_dir, lock)
    return 0


def check_arguments(args: argparse.Namespace) -> None:
    """Raise `CommandError` (one line, exit status 2) for a command that cannot start a job."""
    from phalanx.spec.command_error import CommandError

    if args.nproc_per_node < 1:
        raise CommandError(f"-n must be at least 1 (got {args.nproc_per_node})")
    if args.nnodes < 1:
        raise CommandError(f"--nnodes must be at least 1 (got {args.nnodes})")
    if not 0 <= args.node_rank < args.nnodes:
        raise CommandError(f"--node-rank must be in 0..{args.nnodes - 1} for --nnodes "
                           f"{args.nnodes} (got {args.node_rank})")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise CommandError(f"--master-port must be in 1..65535 (got {args.master_port})")
    if args.max_restarts < 0:
        raise CommandError(f"--max-restarts must be 0 or more (got {args.max_restarts})")
    if args.on_failure == "stop" and args.max_restarts:
        raise CommandError("--on-failure stop ends the job at the first failure, so "
                           f"--max-restarts {args.max_restarts} would never be used; leave one "
                           "of them out")
    if args.join_timeout < 1:
        raise CommandError(f"--join-timeout must be at least 1 second (got {args.join_timeout})")
    if not args.oversubscribe:
        from ..world.processes import check_worker_limit

        try:
            check_worker_limit(args.nproc_per_node, f"-n {args.nproc_per_node}",
                               "pass --oversubscribe to start them anyway")
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    if args.log_dir is not None and (why := why_not_writable_dir(args.log_dir)) is not None:
        raise CommandError(f"--log-dir {args.log_dir}: {why}; name a directory this user can "
                           "write to, or leave --log-dir out (a temporary directory)")
    try:
        socket.getaddrinfo(args.master_addr, None)
    except (OSError, UnicodeError) as exc:
        raise CommandError(f"--master-addr {args.master_addr}: no such host ({exc}); give "
                           "node 0's address or host name, reachable from every node") from None
    # the workers' variables, before any worker starts ([Note: one table of variables]); those
    # the launcher sets for its workers too: a value it replaces is still a mistake to name
    try:
        environment.check()
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if args.script is None:
        raise CommandError(_NEEDS_SCRIPT)
    if args.module:
        if not _module_exists(args.script):
            raise CommandError(f"no module named {args.script!r} (looked in {os.getcwd()} and "
                               "sys.path; is the package installed?)")
    elif not os.path.exists(args.script):
        raise CommandError(f"no such script: {args.script}")


def _module_exists(name: str) -> bool:
    """Whether the top-level package of `name` can be found from the current directory.

    Only the top level is looked up: finding a submodule would import (run) its package here,
    in the launcher. A missing submodule still fails in the workers, with its traceback.
    """
    top = name.partition(".")[0]
    if not top:
        return False
    sys.path.insert(0, os.getcwd())  # workers run `python -m`, which searches the cwd first
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.remove(os.getcwd())


def _wait_for_master(addr: str, port: int, timeout: float) -> bool:
    """Whether node 0's rendezvous accepts connections within `timeout` seconds.

    The agent would find out too, but its store client logs every failed attempt from C++ with
    a stack dump; waiting here first keeps an absent master to one line.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _configure_agent_logging(verbose: bool) -> None:
    """Keep the agent's log lines (INFO and WARNING chatter) out of the user's terminal.

    The agent's loggers live under `torch.distributed.elastic` and `torch.distributed.launcher`
    and print through the handler torch puts on `torch.distributed`. Some of them set their
    own level when created, so each one that exists by now (the agent's modules are imported)
    gets the level, not only the parents; this touches the launcher's process only.
    """
    level = logging.INFO if verbose else logging.CRITICAL
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher")
    for name in [*prefixes, *logging.root.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(level)


def _rendezvous_error(args, port: int, exc: Exception) -> str:
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    where = f"{args.master_addr}:{port}"
    if args.node_rank == 0:
        if "in use" in first_line.lower():
            return f"cannot serve the rendezvous at {where}: the port is in use ({first_line}); " \
                   "choose another --master-port"
        return (f"the rendezvous at {where} failed: not every node joined within "
                f"{args.join_timeout} s ({first_line}); start all {args.nnodes} nodes with the "
                "same --master-addr and --master-port, or raise --join-timeout")
    return (f"the rendezvous at {where} failed ({first_line}); start node 0 with the same "
            "--master-addr and --master-port, or raise --join-timeout")
