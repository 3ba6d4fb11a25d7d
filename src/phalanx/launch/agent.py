"""The elastic agent that runs this node's workers: torch's `LocalElasticAgent`, plus a word on
every restart.

torch's agent restarts a failed worker group silently (its own log line is INFO, hidden with the
rest of its chatter). `_Agent` keeps the last monitoring result, and when the agent restarts the
group after a failure it hands that attempt's failures to a callback first (`phalanx run` prints
one line: which rank failed, how, and which attempt starts) and keeps what the callback returns,
so the final message can list the earlier attempts.

The agent is built here rather than through `torch.distributed.launcher.elastic_launch`, which
always builds a plain `LocalElasticAgent`; `LaunchConfig` still fills in torch's defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.launcher.api import LaunchConfig

from .cleanup import Ending, note_signals
from .continuing import ContinueMixin
from .rendezvous import RENDEZVOUS, RUN_ID, StaticRendezvous

__all__ = ["run_agent"]

# Called as on_restart(attempt, failures, endings) just before attempt number `attempt` (2, 3,
# ...) starts; `failures` maps global rank -> ProcessFailure of the attempt that failed, and
# `endings` global rank -> what the agent did to end that worker (cleanup.py).
OnRestart = Callable[[int, dict, dict], object]


class _Agent(LocalElasticAgent):
    def __init__(self, *args, on_restart: OnRestart, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_restart = on_restart
        self._last_result: RunResult | None = None
        self.earlier_attempts: list = []  # what on_restart returned, one per restart
        # this attempt's: see [Note: a worker the launcher ended]
        self.endings: dict[int, Ending] = {}

    def _start_workers(self, worker_group):
        ids = super()._start_workers(worker_group)
        self.endings = {}
        for local_rank, handler in self._pcontext.subprocess_handlers.items():
            self.note_signals(worker_group.workers[local_rank].global_rank, handler)
        return ids

    def note_signals(self, rank: int, handler) -> None:
        """Note what the agent sends the worker of global `rank` (a new one: a new note)."""
        self.endings[rank] = Ending()
        note_signals(handler, self.endings[rank])

    def _monitor_workers(self, worker_group) -> RunResult:
        result = super()._monitor_workers(worker_group)
        self._last_result = result
        return result

    def _restart_workers(self, worker_group) -> None:
        # The agent also restarts a healthy group when nodes join (elastic membership); only a
        # restart after a failure is announced. The agent sets the group's state from the
        # monitoring result just before it decides to restart.
        if worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            failures = self._last_result.failures if self._last_result is not None else {}
            attempt = len(self.earlier_attempts) + 2
            self.earlier_attempts.append(self._on_restart(attempt, dict(failures),
                                                          dict(self.endings)))
        super()._restart_workers(worker_group)


class _ContinueAgent(ContinueMixin, _Agent):
    """`--on-failure continue`: one failed worker is replaced, the others go on."""


def run_agent(args: argparse.Namespace, port: int, log_dir: str, worker_args: list[str],
              on_restart: OnRestart, on_failure=None) -> tuple[RunResult, list, dict]:
    """Run `python worker_args...` as this node's workers until they succeed or fail for good.

    Returns the last attempt's result, what `on_restart` returned for each earlier attempt
    (under `--on-failure continue`: what `on_failure(rank, failure)` returned for each failure
    survived), and what the agent did to end each worker of the last attempt (global rank ->
    `cleanup.Ending`). Raises torch's `SignalException` when the launcher is signalled (the workers
    are stopped first) and `DistError` when the rendezvous fails.
    """
    continuing = args.on_failure == "continue"
    config = LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        run_id=RUN_ID,
        rdzv_backend=RENDEZVOUS,
        rdzv_endpoint=f"{args.master_addr}:{port}",
        # under continue the agent never restarts the group: the restarts are replacements
        max_restarts=0 if continuing or args.on_failure == "stop" else args.max_restarts,
        # Output goes through per-rank files that the agent tails onto our stdout and stderr
        # with the rank in front; the files also keep the end of a failed rank's stderr.
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        log_line_prefix_template="[rank${rank}]: ",
    )
    # See [Note: static rendezvous, a fresh store per attempt].
    rendezvous = StaticRendezvous(args.master_addr, port, args.node_rank, args.nnodes,
                                  args.join_timeout, share_store=continuing)
    spec = _worker_spec(config, rendezvous, sys.executable, worker_args)
    agent = (_ContinueAgent if continuing else _Agent)(
        spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout, on_restart=on_restart)
    if continuing:
        agent.setup_continue(args.max_restarts, on_failure)
    signalled = False
    try:
        result = agent.run()
        return result, agent.survived if continuing else agent.earlier_attempts, agent.endings
    except SignalException:
        signalled = True
        raise
    finally:
        if not signalled:  # as torch's launcher: a signalled agent leaves the rendezvous open
            rendezvous.shutdown()


def _worker_spec(config: LaunchConfig, rendezvous, entrypoint: str, args: list[str]) -> WorkerSpec:
    """The `WorkerSpec` that torch's `launch_agent` builds from `config`.

    Only the fields this torch's `WorkerSpec` has are passed, so an older torch that lacks a
    newer one (duplicate stream filters, virtual local ranks) still runs.
    """
    wanted = dict(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rendezvous,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
        event_log_handler=getattr(config, "event_log_handler", "null"),
        numa_options=getattr(config, "numa_options", None),
        duplicate_stdout_filters=getattr(config, "duplicate_stdout_filters", None),
        duplicate_stderr_filters=getattr(config, "duplicate_stderr_filters", None),
        virtual_local_rank=getattr(config, "virtual_local_rank", False),
    )
    fields = {f.name for f in dataclasses.fields(WorkerSpec)}
    return WorkerSpec(**{k: v for k, v in wanted.items() if k in fields})
