"""Continue mode (`phalanx run --on-failure continue`) as the floors below it see it.

The engine, the prepared model, the data loader, checkpoints and `px.init` stand below the
package that runs continue mode (phalanx/continuing/: membership, the step boundary, joining,
events), which imports them. They reach it here, through the objects `continuing/session.py`'s
`start` puts in this process's state (process.py's `ContinuingState`: the Membership and the
StepBoundary, None when continue mode is off) and the calls below, which ask those objects.
`px.init` starts continue mode through `start`, which phalanx/__init__.py installs once
(`install`), so that no import runs back up a floor.

Only `phalanx run --on-failure continue` turns it on (PHALANX_ON_FAILURE=continue, read by
`px.init`); otherwise nothing here runs and a failure ends the job as before.
"""

from __future__ import annotations

import weakref

from ..world import environment
from ..world.process import state
from .gate import continuing, gate

__all__ = ["continuing", "step_boundary", "current", "start", "finish", "stop", "raised",
           "iteration_starts", "pass_ended", "gather_for_metrics", "watch_model", "models",
           "check_options", "install", "MembershipError", "ON_FAILURE"]

ON_FAILURE = "PHALANX_ON_FAILURE"


class MembershipError(RuntimeError):
    """The job cannot go on: no member reported in time, or nobody is left to go on with."""


def wanted(env) -> bool:
    """Whether this process runs under `--on-failure continue` as one of several workers."""
    return (environment.value(ON_FAILURE) == "continue" and env.world_size > 1
            and env.master_addr is not None and env.master_port is not None)


def current():
    """The process's Membership (membership.py) under continue mode, else None."""
    return state.continuing.membership


def step_boundary():
    """The process's StepBoundary (steps.py) under continue mode, else None."""
    return state.continuing.steps


def check_options(strategy: str, precision: str, staleness: int, compression, diloco,
                  shard_size) -> None:
    """`px.prepare` under `--on-failure continue`: refuse, on every rank and before any
    collective, what a step redone on another group cannot yet carry over exactly."""
    if not gate.active:
        return
    fix = "; run it under --on-failure restart (every worker restarts from the last checkpoint)"
    if diloco is not None:
        raise ValueError("phalanx run --on-failure continue: strategy=DiLoCo is not supported "
                         "yet: its inner steps carry state from one sync to the next" + fix)
    if precision == "fp16":
        raise ValueError("phalanx run --on-failure continue: precision='fp16' is not supported "
                         "yet: the loss scale each rank sends depends on the number of ranks; "
                         "use precision='bf16'" + fix)
    if staleness or compression is not None:
        what = "staleness=1" if staleness else "compression=PowerSGD"
        raise ValueError(f"phalanx run --on-failure continue: {what} is not supported yet: its "
                         "state spans steps, and a lost step would leave the ranks' states "
                         "apart" + fix)


def iteration_starts(batch: bool = False) -> bool:
    """An iteration begins: `batch`, a `px.data_loader` fetches a batch; else a forward with
    gradients starts (a training step is then in flight). Where training, or an evaluation,
    goes on after a recovery (steps.py). True if it went on here."""
    steps = state.continuing.steps
    return steps is not None and steps.iteration_starts(batch)


def gather_for_metrics(sampler, gather, empty, comm):
    """`px.gather_for_metrics` of a loader over `sampler` (None: a stream's): `gather()`, or
    under continue mode, where a rank is lost, `empty()` and the batch served again ([Note:
    an evaluation redone] in gathers.py)."""
    steps = state.continuing.steps
    if steps is None or not gate.active:
        return gather()
    return steps.gathers.gather(sampler, gather, empty, comm)


def pass_ended(sampler) -> None:
    """A `px.data_loader` pass ran to its end: its sampler's ledger must balance, unless a
    recovery is still under way ([Note: the ledger] in data/ledger.py); an evaluation that lost
    a batch it could not serve again says so (gathers.py)."""
    steps = state.continuing.steps
    if steps is not None and not state.continuing.failed:
        steps.gathers.pass_ended(sampler)
        _checked(steps, [sampler], "at the end of a pass over the data")


def _checked(steps, samplers, when: str) -> None:
    try:
        steps.check_ledgers(samplers, when)
    except Exception as exc:
        state.continuing.failed = True  # it does not say `done` (stop)
        _over(exc)
        raise


def _over(exc: BaseException) -> None:
    """`exc` ends this worker; a MembershipError also ends the job (its agents replace
    nobody: continuing/store.py's `over`)."""
    m = state.continuing.membership
    if m is not None and isinstance(exc, MembershipError):
        try:
            m.post_over(f"{type(exc).__name__}: {exc}"[:300])
        except Exception:  # noqa: BLE001 - the store is gone: so is the job
            pass


def watch_model(prepared) -> None:
    """A prepared model whose engine follows the members (joining.py: its launch order and
    step count agreed, its layout rebuilt where sharded)."""
    if gate.active:
        state.continuing.models.append(weakref.ref(prepared))


def models() -> list:
    """The prepared models `watch_model` was given that still exist, in prepare order."""
    refs = state.continuing.models
    alive = [(ref, ref()) for ref in refs]
    refs[:] = [ref for ref, m in alive if m is not None]
    return [m for _, m in alive if m is not None]


_start: list = []  # continuing/session.py's start, installed by phalanx/__init__.py


def install(start_) -> None:
    """Have `start` call `start_` (continuing/session.py's, installed once by phalanx/__init__,
    which imports every floor)."""
    _start[:] = [start_]


def start(env, backend: str, timeout, device) -> None:
    """`px.init` under continue mode: connect to the job's store and join generation 0 (a
    replacement waits to be admitted instead): continuing/session.py's `start`."""
    _start[0](env, backend, timeout, device)


def finish() -> None:
    """`px.shutdown`, first: a loss seen after this rank's last step is recovered from here,
    so that the survivors end together on one group (steps.py); then every sampler's ledger
    must balance (a step thrown away here is not redone: [Note: the ledger])."""
    steps = state.continuing.steps
    if steps is None or state.continuing.failed:
        return
    if gate.cut:
        steps.finish()
    _checked(steps, list(steps.samplers), "at the end of the job")


def raised(exc: BaseException) -> None:
    """The worker ends on `exc` (launch/worker.py): say so before the process goes, so that
    the others skip this step's batch rather than redo it (steps.py)."""
    m, steps = state.continuing.membership, state.continuing.steps
    state.continuing.failed = True  # no ledger is checked after this; stop() does not say `done`
    _over(exc)
    if m is None or m.joining or m.admitting:  # not in a step: a replacement's own failure
        return
    # The step call it raised in: the one in flight, or, where it raised inside (or after)
    # an optimizer.step() whose vote completed, that one (engine/vote.py's [Note: a step that
    # raised in the optimizer]): the steps after it are then redone, not skipped (steps.py).
    in_step = any(getattr(getattr(p._engine, "vote", None), "in_step", None) is not None
                  for p in models())
    m.write(f"raised/{m.me}.{m.life}",
               {"call": steps.calls if in_step else steps.calls + 1,
                "message": f"{type(exc).__name__}: {exc}"[:300]})


def stop() -> None:
    """`px.shutdown`: this member says it is done (unless it failed); px.shutdown's reset of
    the process state (process.py) then forgets continue mode's objects and the switch."""
    m = state.continuing.membership
    if m is not None and not state.continuing.failed:
        try:
            m.write(f"done/{m.me}.{m.life}", True)
        except Exception:  # noqa: BLE001 - the store is gone: nobody reads the mark
            pass
