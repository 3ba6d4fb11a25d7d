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
its traceback; with --max-restarts K the node's workers are first restarted up to K times.
A mistake in the command itself (no such script, -n 0, no master) is one line and exit
status 2. The elastic agent's own log lines are hidden unless --verbose.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import glob
import importlib.util
import io
import json
import logging
import os
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

__all__ = ["add_arguments", "main"]

# Lines of a failed rank's traceback repeated in the final message (the whole traceback is
# already on stderr, prefixed with the rank).
TRACEBACK_LINES = 12
# The run id names the rendezvous on the master's store, so every node must use the same one.
RUN_ID = "phalanx"
RENDEZVOUS = "phalanx-static"  # the name `_StaticRendezvous` is registered under


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc-per-node", type=int, required=True, metavar="N",
                        help="workers to start on this node (one per GPU, or a few on a CPU)")
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
                        help="restart this node's workers up to K times after a failure (default 0)")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="keep each worker's stdout, stderr and error file under DIR "
                             "(default: a temporary directory, removed at the end)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the elastic agent's own log messages")
    parser.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name, run as `python -m SCRIPT`")
    parser.add_argument("script", metavar="SCRIPT",
                        help="the training script (a path, or a module name with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments passed to every worker's script")


def main(args: argparse.Namespace) -> int:
    from phalanx.cli import CommandError

    _check_arguments(args)
    port = args.master_port
    if port is None:  # one node: port 0 lets the store pick a free port itself
        port = 0 if args.nnodes == 1 else 29500

    # Imported here: a worker runs this file for its entry point and needs none of the agent.
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rendezvous_handler_registry.register(RENDEZVOUS, _create_rendezvous)

    _configure_agent_logging(args.verbose)
    if args.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the agent passes it on to workers
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # workers' lines appear as they come

    if args.node_rank > 0 and not _wait_for_master(args.master_addr, port, args.join_timeout):
        raise CommandError(f"no master at {args.master_addr}:{port} after {args.join_timeout} s; "
                           "start node 0 with the same --master-addr and --master-port, or "
                           "raise --join-timeout")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="phalanx-run-")
    config = LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        run_id=RUN_ID,
        # See [Note: static rendezvous, a fresh store per attempt].
        rdzv_backend=RENDEZVOUS,
        rdzv_endpoint=f"{args.master_addr}:{port}",
        rdzv_configs={"rank": args.node_rank, "timeout": args.join_timeout},
        max_restarts=args.max_restarts,
        # Output goes through per-rank files that the agent tails onto our stdout and stderr
        # with the rank in front; the files also keep the end of a failed rank's stderr.
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        log_line_prefix_template="[rank${rank}]: ",
    )
    worker_args = ["-u", "-m", "phalanx.launch"]  # see `_worker_main`
    worker_args += (["-m"] if args.module else []) + [args.script] + list(args.script_args)
    try:
        elastic_launch(config, sys.executable)(*worker_args)
    except ChildFailedError as exc:
        print(_failure_report(exc.failures, log_dir), file=sys.stderr)
        return 1
    except SignalException as exc:
        print(f"phalanx run: stopped by {exc.sigval.name}; the workers were stopped",
              file=sys.stderr)
        return 128 + int(exc.sigval)
    except DistError as exc:
        raise CommandError(_rendezvous_error(args, port, exc)) from None
    finally:
        if args.log_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    from phalanx.cli import CommandError

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
    if args.join_timeout < 1:
        raise CommandError(f"--join-timeout must be at least 1 second (got {args.join_timeout})")
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


# ---------------------------------------------------------------------------------------------
# The rendezvous


class _StaticRendezvous(StaticTCPRendezvous):
    """[Note: static rendezvous, a fresh store per attempt]

    The job has a fixed shape, so the rendezvous is torch's static one: node 0's agent serves a
    TCP store at master addr:port, every node knows its rank (--node-rank), and nothing beyond
    torch is needed (no etcd, no elastic membership).

    One change: torch's static rendezvous lends that store to the workers and keeps it across
    restarts, so after a restart the process-group keys of the failed attempt are still there
    and a worker connects to a dead peer's address (torch 2.13, with `torchrun
    --max-restarts` as well; see pytorch/pytorch#135712). Here the global rank 0 worker
    serves a new store on a free port at every attempt, the address being shared through the
    agents' store under a per-attempt key: what torch's dynamic rendezvous does with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._attempt = 0

    def get_backend(self) -> str:
        return RENDEZVOUS

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        info = super().next_rendezvous()
        attempt_store = PrefixStore(f"phalanx/attempt_{self._attempt}", info.store)
        self._attempt += 1
        workers_store = RendezvousStoreInfo.build(info.rank, attempt_store,
                                                  local_addr=self.master_addr)
        return RendezvousInfo(info.store, info.rank, info.world_size, workers_store)


def _create_rendezvous(params) -> _StaticRendezvous:
    addr, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    return _StaticRendezvous(addr, port, params.config["rank"], params.max_nodes,
                             params.run_id, int(params.config["timeout"]))


# ---------------------------------------------------------------------------------------------
# Reporting a failed job


def _failure_report(failures: dict, log_dir: str) -> str:
    """One message: the first failed rank, how it ended, the end of its traceback, the others.

    The agent knows every failed rank but orders them by a timestamp in whole seconds, and it
    counts the ranks it stopped itself (SIGTERM) as failures too. The first failure is found
    here from the worker's own error file (a precise time, written by `_record_failure`), or
    for a rank that died without one (a signal, os._exit) from when its stderr was last
    written; ranks ended by SIGTERM come last, since the agent sends that to the survivors.
    """
    def stopped(failure):
        return failure.exitcode == -signal.SIGTERM

    ordered = sorted(failures.items(), key=lambda item: (
        stopped(item[1]), _failure_time(item[1], log_dir), item[0]))
    rank, failure = ordered[0]
    headline, lines = _failure_detail(failure, log_dir)
    text = f"phalanx run: error: rank {rank} {_how_it_ended(failure.exitcode)}"
    text += f": {headline}" if headline else ""
    text += "".join("\n  | " + line for line in lines)
    also = [f"rank {r} ({_how_it_ended(f.exitcode)})" for r, f in ordered[1:] if not stopped(f)]
    if also:
        text += "\n  also failed: " + ", ".join(also)
    halted = [str(r) for r, f in ordered[1:] if stopped(f)]
    if halted:
        text += f"\n  stopped: rank{'s' if len(halted) > 1 else ''} {', '.join(halted)}"
    return text


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def _error_info(failure) -> dict:
    message = failure.error_file_data.get("message")
    return message if isinstance(message, dict) else {}


def _stderr_log(failure, log_dir: str) -> str | None:
    """The newest stderr log of this local rank (the agent keeps one per restart attempt)."""
    pattern = os.path.join(glob.escape(log_dir), "*", "attempt_*", str(failure.local_rank),
                           "stderr.log")
    paths = glob.glob(pattern)
    return max(paths, key=os.path.getmtime) if paths else None


def _failure_time(failure, log_dir: str) -> float:
    precise = _error_info(failure).get("extraInfo", {}).get("time")
    if precise is not None:
        return float(precise)
    path = _stderr_log(failure, log_dir)
    return os.path.getmtime(path) if path else float(failure.timestamp)


def _failure_detail(failure, log_dir: str) -> tuple[str, list[str]]:
    """The failure's one-line cause and the last lines of its traceback (or of its stderr)."""
    info = _error_info(failure)
    callstack = info.get("extraInfo", {}).get("py_callstack", "")
    headline = (str(info.get("message", "")).strip().splitlines() or [""])[0]
    lines = callstack.rstrip().splitlines()
    if not lines:
        path = _stderr_log(failure, log_dir)
        if path:
            with open(path, errors="replace") as f:
                lines = f.read().rstrip().splitlines()
    return headline, lines[-TRACEBACK_LINES:]


# ---------------------------------------------------------------------------------------------
# The worker side: `python -m phalanx.launch [-m] TARGET ARGS...`, started by the agent


def _worker_main(argv: list[str]) -> int:
    """Run the user's script or module as `__main__`, leaving an error file if it fails.

    The agent gives each worker an error file (TORCHELASTIC_ERROR_FILE) in the JSON layout of
    torch.distributed.elastic's `record`; it is written here rather than through `record` to
    add a sub-second time (which rank failed first), to record non-zero sys.exit() codes,
    and to leave this wrapper's frames out of the traceback.
    """
    faulthandler.enable(all_threads=True)  # a crash in C code still prints Python stacks
    is_module = argv[:1] == ["-m"]
    target, script_args = (argv[1], argv[2:]) if is_module else (argv[0], argv[1:])
    sys.argv = [target, *script_args]
    if not is_module and not getattr(sys.flags, "safe_path", False):
        # `python -m` put the cwd first on the path; `python script.py` puts the script's
        # directory there instead.
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    try:
        if is_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            headline = f"sys.exit({exc.code!r})" if isinstance(exc.code, int) else str(exc.code)
            _record_failure(exc.with_traceback(_user_frames(exc.__traceback__)), headline)
        raise
    except BaseException as exc:
        exc = exc.with_traceback(_user_frames(exc.__traceback__))
        _record_failure(exc, f"{type(exc).__name__}: {exc}")
        _print_exception(exc)  # for Ctrl-C too: where each rank was is worth seeing
        return 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def _user_frames(tb):
    """The traceback from the user's first frame on, without runpy's and this module's."""
    start = tb
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    return tb if tb is not None else start


def _print_exception(exc: BaseException) -> None:
    """Print `exc` through sys.excepthook, as Python does with an uncaught exception.

    torch.distributed's hook puts "[rankN]: " before every line; the launcher already does,
    so that prefix is taken off here rather than printed twice.
    """
    buffer = io.StringIO()
    with contextlib.redirect_stderr(buffer):
        sys.excepthook(type(exc), exc, exc.__traceback__)
    prefix = f"[rank{os.environ.get('RANK', '')}]: "
    lines = buffer.getvalue().split("\n")
    sys.stderr.write("\n".join(line.removeprefix(prefix) for line in lines))
    sys.stderr.flush()


def _record_failure(exc: BaseException, headline: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": headline, "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(exc)),
        "timestamp": str(int(now)),  # what the agent reads: whole seconds
        "time": now,
    }}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the traceback is still on stderr


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
