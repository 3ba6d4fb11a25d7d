"""The step of the flat engine: every unit with a reduced gradient steps its master pieces
through the user's optimizer, a run of units at a time, and publishes the update.

[Note: the step in backward]
With `step_in_backward=True` (px.prepare) a unit is stepped as soon as its gradient is
reduced, inside the backward that synchronises (the last micro-batch's under px.no_sync), and
its reduced gradient is let go at once (under zero2/zero3 its gradient shard too), so a rank
holds about one unit's reduced gradient where the ordinary step holds its shard of all of
them until `optimizer.step()`. Which parameters got a gradient on any rank, and whether some
rank's loss was non-finite or its last step failed, ride in every unit's reduced flags and
signal (buckets.py); they are read for each unit as it finishes (a host read per unit instead
of one per backward: host.py), and a unit whose signal says the step must not run is not
stepped but left to the end of backward, which decides as always (the signal is the same in
every unit, so either every unit steps or none does). The optimizer steps only the unit's
holders (optim.py's `step_unit`: its param groups hold just those for the call), so a step
costs what the unit holds, not a walk over every parameter per unit; the update is published
(unshard) on the wire while backward goes on, and waited for at its end. `optimizer.step()`
then only closes the step (its hooks, the step count). The step of each element is the one
the ordinary step makes (the same gradient, state and hyper-parameters, the learning rate of
the same scheduler step), so the weights are the same (tests/test_step_in_backward.py). A
matrix-wise optimizer's whole parameters (owners.py) are the exception: their exchange is
started as the unit finishes but waited for, and the owners step them, at the end of backward
(`step_deferred`), since a rank waiting in backward for the others' slices could wait on a rank
that waits, in a zero3 gather, for it. What needs every gradient before any step is refused: a
global clip, fp16's overflow check.

`Stepper` is a part of `FlatEngine` (flat_engine.py), given at construction what it steps (the
units, the masters' part of state.py, the user's optimizer) and how (under fp16 the loss
scaler, with the overflow flag the end of backward read; under offload the host's step).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .flat import FlatUnit
from .offload import host_kernels
from .policy import ShardPolicy
from .state import Masters
from .units import step_runs

__all__ = ["Stepper"]


class Stepper:
    """The step of `units` (see the module's docstring).

    params: the trainable parameters, whose `.grad` a step without a backward reads.
    delayed: staleness=1's DelayedGrads (delayed.py), or None.
    loss_scaler: fp16's DynamicLossScaler, or None.
    step_chunk_bytes: the size of a run of units (see [Note: fp32 gradients a few units at a
        time] in units.py).
    on_host: offload's step, fn(ready units, unscale, step_one) (offload.py's `step_on_host`),
        or None where the masters are on the device.
    wholes: a matrix-wise optimizer's parameters stepped whole on their owners (owners.py),
        or None.
    fp32_runs: bf16-true: the step works in fp32 (rounding.py), so runs are sized by it.
    """

    def __init__(self, units: list[FlatUnit], params: list, masters: Masters, optimizer,
                 comm, policy: ShardPolicy, *, delayed, loss_scaler, step_chunk_bytes: int,
                 on_host: Callable | None, wholes=None, fp32_runs: bool = False):
        self.units = units
        self.params = params
        self.masters = masters
        self.optimizer = optimizer
        self.comm = comm
        self.reshards = policy.reshards(comm.world)
        self.delayed = delayed
        self.loss_scaler = loss_scaler
        self.step_chunk_bytes = step_chunk_bytes
        self.on_host = on_host
        self.wholes = wholes or None
        self.fp32_runs = fp32_runs  # bf16-true: runs sized by their fp32 step (rounding.py)
        self.overflow: bool | None = None  # fp16: read at the end of the last backward

    def note_overflow(self, found: bool | None) -> None:
        """fp16: whether some rank's reduced gradients overflowed, as the end of the backward
        read it (None: not read there; the step checks then)."""
        self.overflow = found

    def step_units(self, step_one):
        """Run `step_one()` (the user's optimizer step) over the master pieces of every unit
        that has a reduced gradient, those pieces holding their gradient in the master dtype,
        and publish each unit's update, a run of units at a time (see [Note: fp32 gradients a
        few units at a time] in units.py). Where no backward left a reduced gradient, the
        gradients given to the parameters by hand, if any (`_step_given_grads`)."""
        if self.delayed is None and all(u.reduced is None for u in self.units):
            return self._step_given_grads(step_one)
        with self.masters.lock:  # see [Note: reading a peer's shards] in remote.py
            try:
                if self.delayed is not None:
                    self.delayed.take()
                return self._step_units(step_one)
            finally:
                self.masters.stepped(moved=True)
                if self.delayed is not None:
                    self.delayed.stepped()

    def step_now(self, unit: FlatUnit, step_one, comm):
        """[Note: the step in backward]: step `unit` alone through `step_one(unit)`, let its
        reduced gradient go, and start publishing its update, the collectives on `comm` (a
        group of their own). Returns (the publishing's handle or None, None), or for a unit
        with whole parameters (owners.py) (None, what `step_deferred` finishes at the end of
        backward): their exchange is started here and waited for there."""
        with self.masters.lock:  # see [Note: reading a peer's shards] in remote.py
            pending = self._start_gather([unit], 1.0, comm)
            grad = unit.reduced
            if grad.dtype != unit.master_dtype:
                grad = grad.to(unit.master_dtype)
            unit.set_piece_grads(grad)
            raised = None
            try:
                step_one(unit)  # its sliced parameters: the owners' tensors have no gradient yet
            except BaseException as exc:  # noqa: BLE001 - raised once the others are let go
                raised = exc
            unit.set_piece_grads(None)
            unit.reduced = None
            unit.grad_shard = None  # zero2/zero3: the shard goes with the gradient
            for p in unit.params:
                p.grad = None
            if pending is not None:  # `used` is kept for step_deferred
                work, deferred = None, (unit, pending)
            else:
                unit.clear_reduced()
                work, deferred = unit.unshard(comm) if not self.reshards else None, None
        if raised is not None:
            raise raised
        return work, deferred

    def step_deferred(self, deferred: list, step_one, comm) -> None:
        """The whole parameters of the units `step_now` deferred: the owners' exchange it
        started waited for, the owners' step, the updated slices sent back, and the units
        published. At the end of backward: an exchange waited for inside backward could wait
        on a rank that is itself waiting, in a zero3 gather, for this one."""
        with self.masters.lock:
            for _, pending in deferred:
                pending.finish()
            raised = None
            for unit, _ in deferred:
                if raised is None:
                    try:
                        step_one(unit)
                    except BaseException as exc:  # noqa: BLE001 - raised after the exchange
                        raised = exc
            works = []
            for unit, _ in deferred:
                self.wholes.scatter([unit], comm)
                unit.clear_reduced()
                if not self.reshards:
                    works.append(unit.unshard(comm))
            for work in works:
                if work is not None:
                    work.wait()
        if raised is not None:
            raise raised

    def _step_given_grads(self, step_one) -> bool:
        """A step where no backward left a reduced gradient but the parameters were given a
        `.grad` by hand: each master piece takes its slice of its parameter's gradient as given
        (on every rank alike: torch's distributed checkpoint functions create a fresh
        optimizer's state so, with zero gradients at learning rate 0), the user's optimizer
        steps, and the parameters are refreshed from the masters (a collective where they are
        sharded, as the step always is)."""
        given = {id(p): p.grad for p in self.params if p.grad is not None}
        # torch's distributed checkpoint functions make a new optimizer's state so: zero
        # gradients at a learning rate of 0, which moves no master. Such a step is a new
        # version of the optimizer's state but not of the masters, so a peer still reading
        # this rank's masters at the version before (its model's state dict, which
        # get_state_dict reads first) is answered ([Note: reading a peer's shards] in
        # remote.py).
        inert = all(g.get("lr", 1.0) == 0 for g in self.optimizer.param_groups) and \
            not any(bool(g.any()) for g in given.values())
        with self.masters.lock:  # see [Note: reading a peer's shards] in remote.py
            try:
                if not given:
                    return False
                for unit in self.units:
                    unit.sync_master_from_cache()  # See [Note: the shard is the truth] in flat.py
                    for piece in unit.pieces:
                        grad = given.get(id(unit.params[piece.param_index]))
                        piece.master.grad = None if grad is None else \
                            grad.detach().reshape(-1)[piece.start:piece.end].to(
                                piece.master.device, unit.master_dtype).view_as(piece.master)
                if self.wholes is not None:
                    pending = self.wholes.start_gather(
                        self.units, lambda w: torch.cat([p.master.grad.reshape(-1)
                                                         for p in w.mine]))
                    if pending is not None:
                        pending.finish()
                with host_kernels(self.optimizer) if self.on_host is not None \
                        else contextlib.nullcontext():
                    step_one()
                if self.wholes is not None:
                    self.wholes.scatter(self.units)
            finally:
                for unit in self.units:
                    unit.set_piece_grads(None)
                self.masters.stepped(moved=not inert)
        self.masters.publish()
        return True

    def _step_units(self, step_one) -> bool:
        ready = [u for u in self.units if u.reduced is not None]
        if not ready:
            return False
        unscale = 1.0
        if self.loss_scaler is not None:
            found = self.overflow if self.overflow is not None else \
                self.loss_scaler.found_inf([u.reduced for u in ready], self.comm)
            self.overflow = None
            unscale = 1.0 / self.loss_scaler.scale
            self.loss_scaler.update(found)
            if found:
                return False
        if self.on_host is not None:  # the masters are on the host: offload.py
            self.on_host(ready, unscale, step_one)
            return True
        works, raised = [], None
        runs = self._step_runs(ready, unscale)
        # See [Note: whole parameters on owner ranks] in owners.py: each run's owners' gather
        # is on the wire while the run before it steps
        pending = self._start_gather(runs[0], unscale)
        for k, run in enumerate(runs):
            for unit in run:
                grad = unit.reduced
                if grad.dtype != unit.master_dtype or unscale != 1.0:
                    grad = grad.to(unit.master_dtype).mul_(unscale)
                unit.set_piece_grads(grad)
            if pending is not None:
                pending.finish()
            pending = self._start_gather(runs[k + 1], unscale) if k + 1 < len(runs) else None
            if raised is None:
                try:
                    step_one()
                except BaseException as exc:  # noqa: BLE001 - raised once the others are let go
                    raised = exc
            if self.wholes is not None:
                self.wholes.scatter(run)
            for unit in run:
                unit.set_piece_grads(None)
                if not self.reshards:  # zero3 gathers at the next forward (zero3.py)
                    works.append(unit.unshard(self.comm))  # on the wire while the next steps
        for work in works:
            if work is not None:
                work.wait()
        if raised is not None:  # the others are past this step's collectives: see
            raise raised        # [Note: a step that raised in the optimizer] in vote.py
        return True

    def _start_gather(self, run: list[FlatUnit], unscale: float, comm=None):
        """Take edits behind phalanx's back into the run's masters ([Note: the shard is the
        truth] in flat.py), then start the owners' gather of its whole parameters (owners.py;
        None without any)."""
        for unit in run:
            unit.sync_master_from_cache()
        if self.wholes is None:
            return None

        def grad_of(w):  # this rank's slice of the reduced gradient, as the step gives it
            grad = w.unit.reduced[w.mine[0].lo:w.mine[-1].hi]
            if grad.dtype != w.unit.master_dtype or unscale != 1.0:
                grad = grad.to(w.unit.master_dtype, copy=True).mul_(unscale)
            return grad
        return self.wholes.start_gather(run, grad_of, comm)

    def _step_runs(self, ready: list[FlatUnit], unscale: float) -> list[list[FlatUnit]]:
        """The units stepped together (see [Note: fp32 gradients a few units at a time] in
        units.py); with whole parameters always a few units at a time, so that a run's
        owners' exchange overlaps the step of the run before."""
        if all(u.reduced.dtype == u.master_dtype for u in ready) and unscale == 1.0 \
                and self.wholes is None and not self.fp32_runs:
            return [ready]
        bits = [32 if self.fp32_runs else torch.finfo(u.master_dtype).bits for u in ready]
        sizes = [u.reduced.numel() * b // 8 for u, b in zip(ready, bits)]
        return [[ready[i] for i in run] for run in step_runs(sizes, self.step_chunk_bytes)]
