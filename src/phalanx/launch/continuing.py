"""`phalanx run --on-failure continue`: the agent that replaces one failed worker, not all.

torch's agent answers any worker's failure by stopping every worker of the node and, with
restarts left, starting them all again (`LocalElasticAgent`: "if k<=n workers fail all workers
are stopped and restarted"). Under `--on-failure continue` the other workers are left running:
they notice the loss themselves, form a group without it and redo the step in flight
(phalanx/continuing/). This agent's part is small:

- it says who left, at once, in the job's store (`continuing/store.py`: `left/<rank>` with the exit
  status and the time), so the survivors know whom not to wait for;
- after a short grace (`GRACE` seconds: a bug that ends every rank ends them all within it),
  if some worker of the job still runs, the failure is survived: it starts a replacement for
  the failed worker, with the same rank and environment plus PHALANX_JOINING, while
  `--max-restarts` allows (without, the others go on fewer); the replacement's output goes on
  to the same log files (appended), so the console keeps showing it under the same rank;
- a failure after which no worker of the job runs ends the job, as under the other modes;
- a worker that a hang report named is ended here (SIGKILL, which a frozen process receives
  too), as the report asked; the others then go on as after a kill ([Note: a member that
  hangs] in continuing/membership.py);
- once a worker has said that the job cannot go on (`over` in the store: a MembershipError,
  a hang report that names nobody to remove), nobody is replaced, and the workers that do
  not end on their own within `OVER_GRACE` seconds (a frozen one) are ended;
- the job ends when no worker of this node runs any more: it succeeded if no failure ended it,
  whatever failures were survived on the way.

Workers talk through the agent's own store (the rendezvous' TCP store on node 0), which outlives
any worker: under the other modes global rank 0 serves the workers' store, and with it gone
nobody could form a group again.
"""

from __future__ import annotations

import os
import signal
import time

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.api import ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
    SubprocessHandler,
)

from ..continuing import store as job_store
from .worker import end_file

__all__ = ["ContinueMixin", "GRACE", "JOINING", "OVER_GRACE"]

GRACE = 1.0           # seconds between a failure and the decision to replace the worker
OVER_GRACE = 5.0      # seconds the workers get to end on their own once the job cannot go on
JOINING = "PHALANX_JOINING"   # set in a replacement's environment: its number (1, 2, ...)


class _AppendingHandler(SubprocessHandler):
    """A worker process whose output is appended to the files its predecessor wrote (torch's
    handler truncates them, and the agent's tailers follow each file from where they read)."""

    def __init__(self, entrypoint: str, args: tuple, env: dict, stdout: str | None,
                 stderr: str | None, local_rank_id: int):
        self._stdout = open(stdout, "a") if stdout else None
        self._stderr = open(stderr, "a") if stderr else None
        env_vars = os.environ.copy()
        env_vars.update(env)
        self.local_rank_id = local_rank_id
        self.proc = self._popen((entrypoint, *[str(a) for a in args]), env_vars)


class ContinueMixin:
    """The monitoring loop of `--on-failure continue`, for a `LocalElasticAgent` subclass.

    `on_failure(rank, failure, ending)` is called for every failed worker survived and returns
    the line that describes it (kept for the final report; `ending`: what the agent did to end
    it, cleanup.py); `replacements` is how many replacements this node may start in all.
    """

    def setup_continue(self, replacements: int, on_failure) -> None:
        self._replacements_left = replacements
        self._on_failure = on_failure
        self._ended = False   # the agent stopped its workers itself (`_end_the_rest`)
        self.survived: list[str] = []   # what on_failure returned for each failure survived

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        group = self._worker_group
        spec = group.spec
        self._initialize_workers(group)
        store = job_store.keyspace(spec.rdzv_handler._store)  # the raw TCP store, as workers see it
        pcontext = self._pcontext
        running = set(pcontext.subprocess_handlers)
        # local rank -> (when, failure, workers of the job that had finished by then, Ending)
        pending: dict[int, tuple] = {}
        final: dict[int, ProcessFailure] = {}
        node, nodes = group.group_rank, group.group_world_size
        finished = 0
        over_since = None  # when this agent saw that the job cannot go on (the store's `over`)
        notices = 0        # removals and `over` seen so far (continuing/store.py)
        job_store.set_alive(store, node, len(running), finished)
        while True:
            time.sleep(spec.monitor_interval)
            seen = job_store.notices(store)
            if seen != notices:  # written after the keys it counts
                notices = seen
                if over_since is None and job_store.over(store) is not None:
                    over_since = time.monotonic()
                self._remove_asked(store, running)
            for local_rank in sorted(running):
                handler = pcontext.subprocess_handlers[local_rank]
                code = handler.proc.poll()
                if code is None:
                    continue
                running.discard(local_rank)
                finished += code == 0
                job_store.set_alive(store, node, len(running), finished)
                if code == 0:
                    continue
                worker = group.workers[local_rank]
                failure = ProcessFailure(local_rank=local_rank, pid=handler.proc.pid,
                                         exitcode=code, error_file=pcontext.error_files[local_rank])
                ending = self.endings.get(worker.global_rank)
                removed = {"removed": True, "frozen": ending.frozen} \
                    if ending is not None and ending.removed else {}
                job_store.post_left(store, worker.global_rank, self._life(local_rank), code,
                                    failure.timestamp, **removed)
                pending[local_rank] = (time.monotonic(), failure,
                                       job_store.alive_total(store, nodes)[1], ending)
            for local_rank, (when, failure, finished_then, ending) in list(pending.items()):
                if over_since is None and time.monotonic() - when < GRACE:
                    continue
                del pending[local_rank]
                rank = group.workers[local_rank].global_rank
                alive, finished_now = job_store.alive_total(store, nodes)
                if over_since is not None or (not alive and finished_now == finished_then):
                    final[rank] = failure  # nobody went on after it, or nobody can
                    continue
                self.survived.append(self._on_failure(rank, failure, ending))
                if self._replacements_left > 0:
                    self._replacements_left -= 1
                    self._replace(local_rank)
                    running.add(local_rank)
                    job_store.set_alive(store, node, len(running), finished)
            if over_since is not None and running and time.monotonic() - over_since > OVER_GRACE:
                self._end_the_rest(running, final)
            if not running and not pending:
                break
        if final:
            if not self._ended:
                self._stop_workers(group)
            group.state = WorkerState.FAILED
            return RunResult(state=WorkerState.FAILED, failures=final)
        group.state = WorkerState.SUCCEEDED
        self._exit_barrier()
        return RunResult(state=WorkerState.SUCCEEDED,
                         return_values={w.global_rank: None for w in group.workers})

    def _life(self, local_rank: int) -> int:
        """0 for the worker started with the job, k for its k-th replacement."""
        return int(self._pcontext.envs[local_rank].get(JOINING, "0"))

    def _remove_asked(self, store, running: set) -> None:
        """End every running worker that a hang report named ([Note: a member that hangs] in
        continuing/membership.py), with SIGKILL, which a frozen process receives too; its end is
        then seen as any worker's, and its `Ending` says it was removed (cleanup.py)."""
        for local_rank in sorted(running):
            rank = self._worker_group.workers[local_rank].global_rank
            ending = self.endings.get(rank)
            if ending is None or ending.removed or \
                    not job_store.removal_asked(store, rank, self._life(local_rank)):
                continue
            ending.removed = True
            self._pcontext.subprocess_handlers[local_rank].close(signal.SIGKILL)

    def _end_the_rest(self, running: set, final: dict) -> None:
        """The job cannot go on, and these workers have not ended on their own within
        `OVER_GRACE` seconds (a frozen one, a replacement waiting to be admitted): end them
        as after any failure (SIGTERM; a frozen one is continued to receive it: cleanup.py)."""
        self._stop_workers(self._worker_group)
        self._ended = True
        for local_rank in sorted(running):
            handler = self._pcontext.subprocess_handlers[local_rank]
            code = handler.proc.poll()
            final[self._worker_group.workers[local_rank].global_rank] = ProcessFailure(
                local_rank=local_rank, pid=handler.proc.pid,
                exitcode=code if code is not None else -signal.SIGKILL,
                error_file=self._pcontext.error_files[local_rank])
        running.clear()

    def _replace(self, local_rank: int) -> None:
        """Start the worker of `local_rank` again: same rank, same arguments, same log files."""
        pcontext = self._pcontext
        spec = self._worker_group.spec
        error_file = pcontext.error_files[local_rank]
        for stale in (error_file, error_file and end_file(error_file)):  # read already: the
            if stale and os.path.exists(stale):                          # replacement's own
                os.remove(stale)
        env = dict(pcontext.envs[local_rank])
        count = int(env.get(JOINING, "0")) + 1
        env[JOINING] = str(count)
        pcontext.envs[local_rank] = env
        handler = _AppendingHandler(spec.entrypoint, pcontext.args[local_rank], env,
                                    pcontext.stdouts[local_rank], pcontext.stderrs[local_rank],
                                    local_rank)
        pcontext.subprocess_handlers[local_rank] = handler
        self._worker_group.workers[local_rank].id = handler.proc.pid
        self.note_signals(self._worker_group.workers[local_rank].global_rank, handler)

