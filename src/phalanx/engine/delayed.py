"""One-step-delayed gradient averaging: `px.prepare(..., staleness=1)`.

[Note: staleness=1]
Synchronous data parallelism waits, at the end of every backward, for the gradients to be
averaged; over a slow link that wait is the step. With `staleness=1` the average of a step's
gradients gets a whole step to arrive instead, in exchange for being applied one step late:

    the gradient g_t computed at step t on the weights w_t is averaged over the ranks while
    step t+1 runs its forward and backward, and optimizer.step() of step t+1 applies it:
        w_{t+1} = step(w_t, mean(g_{t-1}))          (nothing is applied at the first step)

This is an asynchronous variant with a bounded staleness of one step (the delayed-gradient
form studied for asynchronous SGD, e.g. Zheng et al., "Asynchronous Stochastic Gradient Descent
with Delay Compensation", 2017), not the same training as synchronous data parallelism: the
gradient that moves w_t was computed on w_{t-1}. Every rank applies the same averaged
gradient, so the replicas stay equal.

The first optimizer.step() has nothing to apply: the optimizer is not run at all, so its step
counters, momentum and weight decay are untouched, exactly as a single process that skipped
that step; phalanx's own step count (the step report, the replica check) still counts it.

How: when a bucket of step t is complete in backward, its gradients (and the used-flags and
non-finite signal riding with them, buckets.py) are copied into a buffer of their own and its
average is started (all-reduce, or reduce-scatter to the owned shard under zero2), and not
waited for: backward ends without waiting, and the bucket is free for the next step's
gradients. At the next step, before clipping or the optimizer reads it, those collectives are
waited for and their result becomes each unit's reduced gradient (`unit.reduced`), which is
what the optimizer and `px.clip_grad_norm_` read; clipping clips that delayed average. Each
unit keeps at most two such buffers: the one being applied and the one on the wire. Accumulation
(`px.no_sync` micro-steps) works as usual: the micro-steps add into the bucket, and the last
one's backward starts the average of their sum.

The model's `.grad` after backward hold this rank's own gradient of the step (ddp, zero1) or
None (zero2), not an average: the averaged gradient is the previous step's, and lives in the
engine until it is applied.

A non-finite loss is seen where its gradient would be applied, one step later: the
`on_nonfinite` policy (faults/nonfinite.py) then drops that gradient (the step changes
nothing) and raises or warns, on every rank.

A checkpoint holds the gradient on its way ([Note: the delayed gradient in a checkpoint]
below): it is the same on every rank, so it is saved and resharded like a parameter, and a
resume at any world size applies it at the next step, as the uninterrupted run would.

Refused: zero3 (its gradients are reduced unit by unit as backward frees the unit, into the
owned shard; a second buffer per unit would keep the full gradient it exists to avoid), fp16
(a gradient scaled by one step's loss scale would be unscaled by the next one's).

[Note: the delayed gradient in a checkpoint]
After `optimizer.step()` one averaged gradient is still to be applied: it is part of the
training state, and the engine's part `DelayedGrads` (part.py) gives it to a checkpoint. It is
the same on every rank, so it is stored like a parameter (see [Note: what a checkpoint
stores] in checkpoint/state.py): under `grad/<name>`, in element ranges of the pieces each
rank holds, written by the rank that writes the parameter, and read back at any world size and
strategy into the pieces the loading rank holds. Which parameters got a gradient on some rank
is stored with the small state (`delayed` in it); a parameter that got none has no `grad/`
tensor and is not stepped.

A checkpoint with no `delayed` entry (saved with staleness=0, or before the first step) resumes
with nothing to apply at the next step. A model prepared without staleness drops the stored
gradient, with a warning.
"""

from __future__ import annotations

import torch

from ..comm import host
from ..comm.collectives import Handle
from .part import Part, Range, Saved

__all__ = ["DelayedGrads"]



class _Flight:
    """One unit's gradient of one step, copied out of its bucket and being averaged."""

    def __init__(self, unit, work, buf: torch.Tensor, out: torch.Tensor | None,
                 mine: torch.Tensor):
        self.unit, self.work, self.buf, self.out, self.mine = unit, work, buf, out, mine

    @classmethod
    def done(cls, unit, reduced: torch.Tensor, used: list[bool]) -> "_Flight":
        """A flight already landed (restored from a checkpoint)."""
        flags = torch.tensor([float(u) for u in used] + [0.0], dtype=reduced.dtype,
                             device=reduced.device)
        flight = cls(unit, None, flags, reduced, torch.zeros(1, device=reduced.device))
        flight.tail_at = 0
        return flight

    tail_at = None  # where the flags start in `buf` (None: after the padded gradients)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The owned slice of the average (in the compute dtype) and the reduced flags+signal."""
        if self.work is not None:
            work, self.work = self.work, None
            work.wait()
        unit = self.unit
        at = unit.bucket.padded_numel if self.tail_at is None else self.tail_at
        reduced = self.out if self.out is not None else self.buf[unit.lo:unit.hi]
        if reduced.dtype != unit.compute_dtype:
            reduced = reduced.to(unit.compute_dtype)
        return reduced, self.buf[at:]


class DelayedGrads(Part):
    """The engine's part of staleness=1 (see [Note: staleness=1])."""

    name = "grad"             # grad/<param>: [Note: the delayed gradient in a checkpoint]
    small_at = ("delayed",)

    def __init__(self, engine):
        self.engine = engine
        self.current: list[_Flight] = []        # started since the last optimizer.step()
        self.waiting: list[_Flight] | None = None  # started before it: applied at the next one
        self.taken = False  # the waiting flights were turned into unit.reduced for this step

    # -- backward ------------------------------------------------------------------------------
    def launch(self, unit) -> None:
        """From the engine's launch: copy the complete bucket out and start its average."""
        engine, bucket = self.engine, unit.bucket
        comm_dtype = engine.precision.comm_dtype
        # one flat copy [gradients | padding | flags | signal], also where the bucket keeps its
        # flags apart (see [Note: a gradient reduced where autograd made it] in buckets.py)
        dtype = comm_dtype or bucket.buffer.dtype
        if bucket.tail_apart:  # the cat is the copy (cast on the way where comm_dtype asks)
            buf = torch.cat([bucket.grads().to(dtype), bucket.tail().to(dtype)])
        else:
            buf = bucket.buffer.to(dtype, copy=True)
        mine = buf[-1:].clone()  # this rank's own non-finite signal, before averaging
        out, work = None, None
        if engine.world > 1:
            tag = f"unit[{unit.index}]:delayed grads"
            if engine.shard_grads and engine.comm.uses_reduce_scatter:
                out = torch.empty(unit.hi - unit.lo, dtype=buf.dtype, device=buf.device)
                grads = engine.comm.reduce_shard(buf[:bucket.padded_numel], out, tag=tag)
                flags = engine.comm.all_reduce(buf[bucket.padded_numel:], async_op=True,
                                               tag=tag + ":flags")
                work = Handle(grads.works + flags.works, records=grads.records + flags.records)
            else:
                work = engine.comm.all_reduce(buf, async_op=True, tag=tag)
        self.current.append(_Flight(unit, work, buf, out, mine))

    def finish(self, unit) -> None:
        """From the engine's finish, right after `launch`: the bucket was copied, so under
        sharded gradients it goes back to the pool at once (`.grad` None, as under zero2);
        under full gradients it keeps this rank's gradients, which the next backward replaces
        (after zero_grad) or adds to."""
        if self.engine.shard_grads:
            for p in unit.params:
                p.grad = None
            unit.bucket.free()

    def after_backward(self) -> None:
        """The end of a backward: nothing to wait for or read. This rank's non-finite flag went
        out in the buckets' signal; it is decided on when the gradient is applied."""
        watch = self.engine.nonfinite
        if watch is not None:
            watch.local = None

    # -- the step --------------------------------------------------------------------------------
    def take(self) -> None:
        """Before clipping or the optimizer: the previous step's averages, waited for, become
        the units' reduced gradients (in one read of the device for the flags); units with none
        have no reduced gradient, so the optimizer is not run for them."""
        if self.taken:
            return
        self.taken = True
        engine = self.engine
        for unit in engine.units:
            unit.clear_reduced()
        flights, self.waiting = self.waiting or [], []
        if not flights:
            return
        landed = [(f, *f.wait()) for f in flights]
        values = host.read(torch.cat([tail.float() for _, _, tail in landed]
                                     + [f.mine.float().reshape(-1) for f, _, _ in landed]))
        at, any_rank = 0, False
        for flight, reduced, tail in landed:
            unit, n = flight.unit, tail.numel()
            used, nonfinite = [v > 0 for v in values[at:at + n - 1]], values[at + n - 1] > 0
            at += n
            any_rank = any_rank or nonfinite
            if unit.reduced is None:
                unit.reduced, unit.used = reduced, used
            else:  # a second backward that communicated before this step: the sum, as in one
                unit.reduced = unit.reduced + reduced  # process's accumulation
                unit.used = [a or b for a, b in zip(unit.used, used)]
        mine = any(v > 0 for v in values[at:])
        watch = engine.nonfinite
        if watch is not None:
            try:
                drop = watch.after_backward(any_rank, mine, max(engine.steps.value - 1, 0))
            except FloatingPointError:  # NonFiniteError: its gradients are dropped first
                self.drop()
                raise
            if drop is not None:
                self.drop()

    def drop(self) -> None:
        for unit in self.engine.units:
            unit.clear_reduced()

    def stepped(self) -> None:
        """After optimizer.step(): what this step started is applied at the next."""
        self.waiting, self.current, self.taken = self.current, [], False

    # -- checkpoints: [Note: the delayed gradient in a checkpoint] ------------------------------
    def pending(self) -> list[tuple[object, torch.Tensor, list[bool]]] | None:
        """The averages the next step applies, waited for: (unit, owned reduced slice, used),
        or None when the next step applies nothing."""
        if self.current:
            raise RuntimeError(
                "px.save with staleness=1 was called between a backward and its "
                "optimizer.step(): the averaged gradients of two steps are on their way then, "
                "and a checkpoint holds one; save after optimizer.step()")
        if not self.waiting:
            return None
        flights = []
        for flight in self.waiting:
            reduced, tail = flight.wait()
            flights.append((flight, reduced, tail))
        values = host.read(torch.cat([tail.float() for _, _, tail in flights]))
        out, at = [], 0
        for flight, reduced, tail in flights:
            n = tail.numel()
            out.append((flight.unit, reduced, [v > 0 for v in values[at:at + n - 1]]))
            at += n
        return out

    def restore(self, landed: list[tuple[object, torch.Tensor, list[bool]]] | None) -> None:
        """Make `landed` ((unit, owned reduced slice, used) per unit) what the next step
        applies; None: the next step applies nothing."""
        self.current, self.taken = [], False
        self.waiting = None if landed is None else [
            _Flight.done(unit, reduced, used) for unit, reduced, used in landed]

    @torch.no_grad()
    def state(self, saving) -> Saved:
        """This rank's ranges of the gradient on its way, and the names of the parameters that
        have one (the small values); nothing when the next step applies nothing."""
        landed = self.pending()
        if landed is None:
            return Saved()
        names = saving.names
        used, out = [], []
        for unit, reduced, flags in landed:
            for i, p in enumerate(unit.params):
                if flags[i] and id(p) in names:
                    used.append(names[id(p)])
            for piece in unit.pieces:
                name = names.get(id(unit.params[piece.param_index]))
                if name is None or not flags[piece.param_index] or not saving.writes(name):
                    continue
                values = reduced[piece.lo:piece.hi].to(unit.master_dtype)
                out.append(Range(name, piece.start, piece.end, values, like=name))
        return Saved(out, {"used": sorted(set(used))})

    @torch.no_grad()
    def load(self, loading) -> None:
        """Make the stored gradient the one the next step applies; none stored: nothing."""
        if loading.small is None:
            self.restore(None)
            return
        used = set(loading.small["used"])
        landed = []
        for unit in self.engine.units:
            names = [loading.names.get(id(p)) for p in unit.params]
            flags = [name in used for name in names]
            reduced = torch.zeros(unit.hi - unit.lo, dtype=unit.compute_dtype,
                                  device=unit.bucket.device)
            for piece in unit.pieces:
                if flags[piece.param_index]:
                    loading.read_into(names[piece.param_index], piece.start, piece.end,
                                      reduced[piece.lo:piece.hi])
            landed.append((unit, reduced, flags))
        self.restore(landed)

    @classmethod
    def left_out(cls, loading) -> None:
        """A model prepared without staleness drops the stored gradient, and rank 0 says so."""
        if loading.small is not None and loading.comm.rank == 0:
            loading.warn("the checkpoint holds an averaged gradient still to be applied "
                         "(saved with staleness=1), and this model was prepared without "
                         "staleness: it is dropped")
