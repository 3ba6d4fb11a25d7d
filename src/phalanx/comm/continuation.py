"""Continue mode (`phalanx run --on-failure continue`) as the floors below it see it: one object.

The engine, the prepared model, the data loader, checkpoints and `px.init` stand below the
package that runs continue mode (phalanx/continuing/: membership, the step boundary, joining,
events), which imports them. They reach it through one object, this process's `Continuation`,
which `now()` gives: under continue mode the one continuing/session.py's `start` made at
`px.init` and keeps in this process's state (process.py's `Continuing`, reset by px.shutdown);
otherwise `Continuation` itself, whose every call does what a job without continue mode does
(nothing, or the plain thing). So a caller makes its call without asking first whether continue
mode is on, and never holds what is inside (the members, the step boundary). `px.init` starts
it through `start`, which phalanx/__init__.py installs once (`install`), so that no import runs
back up a floor.

Whether continue mode is on is asked one way, `continuing()` (comm/gate.py's switch, which
every collective reads), by a caller whose own choice differs under it (a group that changes
from step to step, a wait that looks at the members).

Only `phalanx run --on-failure continue` turns it on (PHALANX_ON_FAILURE=continue, read by
`px.init`); otherwise nothing here runs and a failure ends the job as before.
"""

from __future__ import annotations

from ..world import environment
from ..world.process import state
from .gate import continuing

__all__ = ["Continuation", "now", "continuing", "start", "install", "wanted", "MembershipError",
           "ON_FAILURE"]

ON_FAILURE = "PHALANX_ON_FAILURE"


class MembershipError(RuntimeError):
    """The job cannot go on: no member reported in time, or nobody is left to go on with."""


class Continuation:
    """The calls the floors below make of continue mode, as they run when it is off; each says
    what it does under continue mode, where continuing/session.py's `Session` answers them.
    Grouped by the floor that calls them."""

    # -- the data loader and its sampler (data/) ------------------------------------------------
    def replay(self, sampler) -> bool:
        """A sampler's replay part is made (data/replay.py's `Replay`, a `Replayable`): under
        continue mode the step boundary drives it from here on (it commits, goes back, leaves
        out: [Note: a step redone] in data/replay.py), and True: it keeps a ledger ([Note: the
        ledger] in data/ledger.py). Off: False."""
        return False

    def iteration_starts(self, batch: bool = False) -> bool:
        """An iteration begins: `batch`, a `px.data_loader` fetches a batch; else a forward with
        gradients starts (a training step is then in flight). Where training, or an evaluation,
        goes on after a recovery (continuing/steps.py). True if it went on here."""
        return False

    def pass_ended(self, sampler) -> None:
        """A `px.data_loader` pass over `sampler` (its replay part) ran to its end: its ledger
        must balance, unless a recovery is still under way ([Note: the ledger]); an evaluation
        that lost a batch it could not serve again says so (continuing/gathers.py)."""

    def gather_for_metrics(self, sampler, gather, empty, comm):
        """`px.gather_for_metrics` of a loader over `sampler` (its replay part; None: a
        stream's): `gather()`, or under continue mode, where a rank is lost, `empty()` and the
        batch served again ([Note: an evaluation redone] in continuing/gathers.py)."""
        return gather()

    # -- the prepared model (model/) -------------------------------------------------------------
    def watch_model(self, prepared) -> None:
        """A prepared model whose engine follows the members (continuing/joining.py: its launch
        order and step count agreed, its layout rebuilt where sharded)."""

    def watch_clock(self, clock, engine) -> None:
        """A prepared model's step clock (observe/step_report.py): its report shows each change
        of members, and it reads the new group's records after one (continuing/events.py)."""

    def before_step(self, comm) -> bool:
        """`optimizer.step()` begins: whether the step may run (False: the caller drops its
        gradients, so that the step changes nothing). Under continue mode the commit vote
        over `comm`, and a recovery where the step was lost ([Note: the commit vote] in
        continuing/steps.py)."""
        return True

    def models(self) -> list:
        """The prepared models `watch_model` was given that still exist, in prepare order."""
        return []

    # -- checkpoints (checkpoint/) ----------------------------------------------------------------
    def joining(self) -> bool:
        """Whether this process is a replacement not yet admitted to the job ([Note: joining at
        a save] in continuing/joining.py): it has the others' state still to take."""
        return False

    def wait_for_admission(self) -> str:
        """A replacement's `px.latest_checkpoint`: ask to join, wait until the others admit it
        at their next `px.save`, and return the checkpoint that save wrote. Only a replacement
        (`joining()`) waits."""
        raise RuntimeError(_NOT_JOINING)

    def join_at_load(self, load) -> dict:
        """A replacement's `px.load`: be admitted, form the group with the others, and
        `load(path)` the checkpoint they just saved (their live state); returns what `load`
        returns. Only a replacement (`joining()`) joins."""
        raise RuntimeError(_NOT_JOINING)

    def joiners_asking(self, comm) -> list:
        """At the start of a `px.save` (every member calls it, over `comm`): the replacements
        asking to join, which this save admits once complete (`admit_at_save`). Off: none."""
        return []

    def saved(self, path: str, model, optimizer, stateful: dict) -> None:
        """A `px.save` of `path` is written: where a sharded engine takes its state back from
        after a loss ([Note: a sharded engine after a loss] in continuing/steps.py)."""

    def admit_at_save(self, comm, asking: list, path: str, model, optimizer,
                      stateful: dict) -> None:
        """At the end of a `px.save` that wrote `path`: admit `asking` (from `joiners_asking`),
        every member loading `path` as the replacements do ([Note: joining at a save])."""

    # -- the shard service (engine/remote.py) ----------------------------------------------------
    def generation(self) -> int | None:
        """The generation of members this process is in (each has its own keys in the job's
        store: [Note: generations] in continuing/membership.py); None when off."""
        return None

    def member_gone(self) -> int | None:
        """The launch rank of a member of this generation known to have left the job (an
        answer it owes will not come), or None."""
        return None

    # -- px.init, px.shutdown (world/runtime.py) and the worker's end (launch/worker.py) ----------
    def watch_hangs(self, watch) -> None:
        """A hang watcher (faults/hangs.py's HangWatch) over the job's group: under continue
        mode it looks for a request to report at every tick ([Note: a member left behind] in
        continuing/steps.py) and has the ranks a hang report names removed ([Note: a member
        that hangs] in continuing/membership.py)."""

    def finish(self) -> None:
        """`px.shutdown`, first: a loss seen after this rank's last step is recovered from here,
        so that the survivors end together on one group (continuing/steps.py); then every
        sampler's ledger must balance (a step thrown away here is not redone: [Note: the
        ledger])."""

    def raised(self, exc: BaseException) -> None:
        """The worker ends on `exc` (launch/worker.py): say so before the process goes, so that
        the others skip this step's batch rather than redo it (continuing/steps.py)."""

    def stop(self) -> None:
        """`px.shutdown`: this member says it is done (unless it failed); px.shutdown's reset of
        the process state (process.py) then forgets continue mode's object and the switch."""


_NOT_JOINING = ("phalanx: only a replacement under `phalanx run --on-failure continue` joins "
                "the others (continuation.now().joining() is False here); this is a bug in "
                "phalanx: please report it")

_OFF = Continuation()


def now() -> Continuation:
    """This process's continue mode: the `Session` `px.init` made under `--on-failure
    continue` (continuing/session.py), else the one that is off."""
    return state.continuing.session or _OFF


def wanted(env) -> bool:
    """Whether this process runs under `--on-failure continue` as one of several workers."""
    return (environment.value(ON_FAILURE) == "continue" and env.world_size > 1
            and env.master_addr is not None and env.master_port is not None)


_start: list = []  # continuing/session.py's start, installed by phalanx/__init__.py


def install(start_) -> None:
    """Have `start` call `start_` (continuing/session.py's, installed once by phalanx/__init__,
    which imports every floor)."""
    _start[:] = [start_]


def start(env, backend: str, timeout, device, regrouped, lost) -> None:
    """`px.init` under continue mode: connect to the job's store and join generation 0 (a
    replacement waits to be admitted instead): continuing/session.py's `start`, which makes
    this process's `Session` (`now()` from then on). `regrouped(rank, world)` is called with
    this rank's place after each new group of members forms, `lost()` as the wire is cut."""
    _start[0](env, backend, timeout, device, regrouped, lost)
