"""Continue mode for this process, one object: the `Session` `px.init` makes (see the package
docstring).

phalanx/__init__.py installs `start` in comm/continuation.py, through which `px.init` starts
continue mode; from then on the engine, the prepared model, the data loader and checkpoints,
which stand below this package, make their calls of it through `continuation.now()`, which
answers with the `Session` kept in the process state. Each call is one method of
comm/continuation.py's `Continuation` (where each is described, and what it does when continue
mode is off); here it is answered by the members (membership.py), the step boundary (steps.py)
and a replacement's admission (joining.py), which nothing below this package holds.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

from ..comm.continuation import Continuation, MembershipError
from ..comm.gate import gate
from ..world import environment
from ..world.process import state
from .events import Events
from .membership import Membership
from .steps import StepBoundary

__all__ = ["Session", "start"]


def start(env, backend: str, timeout, device, regrouped, lost) -> None:
    """comm/continuation.py's `start` (see it): this process's `Session`, kept in its state,
    the switch turned on, and generation 0 formed (a replacement waits to be admitted)."""
    client = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)
    life = environment.value("PHALANX_JOINING") or 0
    m = Membership(client, env.rank, env.world_size, life, backend, timeout, device)
    session = state.continuing.session = Session(client, m)
    gate.active = True
    gate.cut = False
    gate.on_loss = session.steps.lost
    m.on_regroup.append(lambda _group: regrouped(m.rank, m.world))
    session.steps.on_lost.append(lost)
    m.start()


class Session(Continuation):
    """This process under continue mode: its members, its step boundary and what says each
    change (events.py); the calls the floors below make (comm/continuation.py's
    `Continuation`, whose docstrings say what each does)."""

    def __init__(self, client, membership: Membership):
        self.client = client  # the job's store: held for the process's life
        self.membership = membership
        self.steps = StepBoundary(membership)
        self.events = Events(membership, self.steps)
        self.failed = False   # the worker ends on an error: no ledger checked, no `done` said
        self._models: list = []  # weak references to the prepared models, in prepare order

    # -- the data loader and its sampler ---------------------------------------------------------
    def replay(self, sampler) -> bool:
        self.steps.samplers.add(sampler)
        return True

    def iteration_starts(self, batch: bool = False) -> bool:
        return self.steps.iteration_starts(batch)

    def pass_ended(self, sampler) -> None:
        if not self.failed:
            self.steps.gathers.pass_ended(sampler)
            self._checked([sampler], "at the end of a pass over the data")

    def gather_for_metrics(self, sampler, gather, empty, comm):
        return self.steps.gathers.gather(sampler, gather, empty, comm)

    # -- the prepared model ------------------------------------------------------------------------
    def watch_model(self, prepared) -> None:
        self._models.append(weakref.ref(prepared))

    def watch_clock(self, clock, engine) -> None:
        self.events.watch(clock, engine)

    def before_step(self, comm) -> bool:
        return self.steps.before_step(comm)

    def models(self) -> list:
        refs = self._models
        alive = [(ref, ref()) for ref in refs]
        refs[:] = [ref for ref, m in alive if m is not None]
        return [m for _, m in alive if m is not None]

    # -- checkpoints -------------------------------------------------------------------------------
    def joining(self) -> bool:
        return self.membership.joining

    def wait_for_admission(self) -> str:
        return self.steps.admission_path()

    def join_at_load(self, load) -> dict:
        return self.steps.join(load)

    def joiners_asking(self, comm) -> list:
        return self.steps.joiners_asking(comm)

    def saved(self, path: str, model, optimizer, stateful: dict) -> None:
        self.steps.saved(path, model, optimizer, stateful)

    def admit_at_save(self, comm, asking: list, path: str, model, optimizer,
                      stateful: dict) -> None:
        self.steps.admit(comm, asking, path, model, optimizer, stateful)

    # -- the shard service -------------------------------------------------------------------------
    def generation(self) -> int | None:
        return self.membership.gen

    def member_gone(self) -> int | None:
        m = self.membership
        return next((rank for rank, life in list(m.members) if m.gone(rank, life) is not None),
                    None)

    # -- px.init, px.shutdown and the worker's end -------------------------------------------------
    def watch_hangs(self, watch) -> None:
        watch.on_tick, watch.on_hang = self.steps.watch_tick, self.membership.remove_hung

    def finish(self) -> None:
        if self.failed:
            return
        if gate.cut:
            self.steps.finish()
        self._checked(list(self.steps.samplers), "at the end of the job")

    def raised(self, exc: BaseException) -> None:
        m, steps = self.membership, self.steps
        self.failed = True  # no ledger is checked after this; stop() does not say `done`
        self._over(exc)
        if m.joining or m.admitting:  # not in a step: a replacement's own failure
            return
        # The step call it raised in: the one in flight, or, where it raised inside (or after)
        # an optimizer.step() whose vote completed, that one (engine/vote.py's [Note: a step that
        # raised in the optimizer]): the steps after it are then redone, not skipped (steps.py).
        in_step = any(getattr(getattr(p._engine, "vote", None), "in_step", None) is not None
                      for p in self.models())
        m.write(f"raised/{m.me}.{m.life}",
                {"call": steps.calls if in_step else steps.calls + 1,
                 "message": f"{type(exc).__name__}: {exc}"[:300]})

    def stop(self) -> None:
        m = self.membership
        if not self.failed:
            try:
                m.write(f"done/{m.me}.{m.life}", True)
            except Exception:  # noqa: BLE001 - the store is gone: nobody reads the mark
                pass

    # -- the end of a worker -----------------------------------------------------------------------
    def _checked(self, samplers, when: str) -> None:
        try:
            self.steps.check_ledgers(samplers, when)
        except Exception as exc:
            self.failed = True  # it does not say `done` (stop)
            self._over(exc)
            raise

    def _over(self, exc: BaseException) -> None:
        """`exc` ends this worker; a MembershipError also ends the job (its agents replace
        nobody: store.py's `over`)."""
        if isinstance(exc, MembershipError):
            try:
                self.membership.post_over(f"{type(exc).__name__}: {exc}"[:300])
            except Exception:  # noqa: BLE001 - the store is gone: so is the job
                pass
