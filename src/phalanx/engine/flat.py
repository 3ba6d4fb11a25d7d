"""A unit of the flat engine: its parameters' flat storage, its owned shard, its master pieces.

[Note: the shard is the truth]
Each rank owns the slice [lo, hi) of every unit's flat buffer (all of it when the optimizer
state is not sharded). The *master* of that slice, in the parameters' own dtype (fp32 for an
fp32 model, fp64 for an fp64 one), is the truth: the optimizer updates it and nothing else.
The full flat buffer in the compute dtype, which the model's parameters are views into, is a
cache of the masters of every rank: `unshard()` refreshes it (writes the owned master into it,
cast, then gathers the other ranks' slices) and the policy decides whether it stays between
steps (ddp, zero1, zero2) or is freed (zero3, zero3.py). When compute and master
dtypes agree, the master is the owned slice of the flat buffer itself (no copy). When neither
sharding nor low precision is asked for (fp32 ddp) there is no flat buffer and no master at all:
each parameter is its own master and the optimizer is left exactly as the user built it.

The optimizer does not see the flat master: it sees *pieces*, one per parameter that overlaps
the owned slice, each a view into the master (the parameter's shape when the piece is the whole
parameter, flat otherwise). So a parameter that got no gradient on any rank has pieces whose
`.grad` is None, and the optimizer skips it as one process would: no weight decay, momentum or
step count touches it. And the optimizer state is per parameter piece, which is what lets it
be reassembled into the per-parameter state a single process has (optim.py).

[Note: frozen parameters in a unit]
Under zero3 a unit also holds the frozen parameters of the modules it covers (the engine plans
its units over every floating parameter, trainable or not: units.py), after its trainable ones:
the flat buffer is [trainable, padded to the world size | frozen, padded likewise], each
segment sharded 1/N per rank and gathered by an all-gather of its own, both views of one
storage freed and given back together. The owned slice of the frozen segment lives in
`frozen_shard`, in the compute dtype (the dtype frozen parameters are cast to: model/
precision.py): no master, no slot in the gradient bucket, no optimizer state, never reduced.
Its pieces (`frozen_pieces`, indexed into `members`) are how a checkpoint, a load and a meta
build reach it, as the masters' pieces are. A unit of frozen parameters only has no bucket; the
engine keeps such units apart from those with gradients (flat_engine.py). The other strategies
keep whole parameters between steps, frozen ones included, and their units hold trainable
parameters only.

A change made to the parameters behind phalanx's back (an in-place edit, through `.data` too,
which no version counter sees; a load through the user's module is not one: its hooks set the
masters from the loaded values, model/prepared.py) leaves the cache different
from the master cast to the compute dtype. `sync_master_from_cache()`, run on each unit just
before it steps, compares the two and takes exactly the changed elements into the master, so
elements nobody touched keep their full precision. It costs two passes over the owned slice
per step, unit by unit (the comparison, and a select that rewrites the master), and no read
on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.collectives import Handle
from .buckets import BufferPool, GradBucket
from .policy import ShardPolicy
from .vote import FAILED_AT

__all__ = ["FlatUnit", "Piece", "UnitContext", "PIECE_CAP"]

# [Note: a cap on a piece]
# A piece longer than this many elements is cut into pieces of at most this many, each a
# tensor the optimizer steps (and keys its state by) of its own. The optimizer's temporaries,
# bf16-true's fp32 copy of what it steps (rounding.py) and torchao's dequantized low-bit state
# are made per tensor, so a parameter as long as a large vocabulary's embedding or head (525M
# elements at 128K x 4096: 262M on each of two ranks, 4 GiB in fp32 with two moments) costs a
# cap's worth at a time instead of all of it. An element-wise optimizer steps each element
# alike whatever tensor it sits in, so nothing else changes: checkpoints and the state_dict
# go by element ranges. 2^22 elements: 64 MiB with an fp32 copy and two moments; a multiple
# of every block a low-bit state uses.
PIECE_CAP = 1 << 22


@dataclass
class Piece:
    """The part of one parameter that this rank owns: `param.view(-1)[start:end]`."""
    param_index: int   # position in the unit
    start: int         # within the flattened parameter
    end: int
    master: torch.nn.Parameter  # what the optimizer holds (the parameter itself when whole and own)
    lo: int            # within the owned slice
    hi: int

    @classmethod
    def whole(cls, param, index: int = 0, offset: int = 0) -> "Piece":
        """All of `param`, its own master (at `offset` in its unit's buffer)."""
        return cls(index, 0, param.numel(), param, offset, offset + param.numel())


@dataclass(frozen=True)
class UnitContext:
    """What every unit of one engine shares: the strategy's row (policy.py) over a world of
    `world` ranks and this rank's place in it; whether the optimizer is adopted (`adopt`: the
    masters have storage of their own, see [Note: the shard is the truth]; otherwise each
    parameter is its own master); the pool zero2 and zero3 lend bucket buffers from
    (buckets.py); and offload's HostLink (offload.py), None keeping everything on the device."""
    policy: ShardPolicy
    world: int
    rank: int
    adopt: bool
    pool: BufferPool | None = None
    host: object = None
    align: int = 1  # shard boundaries on this many elements of each parameter (buckets.py)


class FlatUnit:
    """One run of parameters, laid out flat (see [Note: the shard is the truth]): `params`,
    the trainable ones, in the order of the gradient bucket; `frozen`, zero3's frozen
    parameters gathered with them (see [Note: frozen parameters in a unit])."""

    def __init__(self, index: int, params: list[torch.nn.Parameter],
                 frozen: list[torch.nn.Parameter] = (), *, compute_dtype: torch.dtype,
                 context: UnitContext):
        policy, world, rank = context.policy, context.world, context.rank
        sharded = policy.shards_optimizer(world)
        reshards = policy.reshards(world)
        self.index = index
        # offload (offload.py): the masters on the host, and with `shards_on_host` zero3's
        # shards between uses too; `host` is the HostLink, None keeps everything on the device
        self.host = context.host
        self.shards_on_host = policy.shards_on_host(world)
        self.kept: torch.Tensor | None = None  # zero3 offloaded: what the gathers start from
        # offload="optimizer" with sharded gradients: the reduced shard's home on the host,
        # where it goes as it is made (`offload_grad`; offload.py's [Note: offload])
        self.host_grad: torch.Tensor | None = None
        self.host_filled = False  # it holds a backward's gradient since the last zero_grad
        self.params = params  # the trainable ones: the gradient bucket's, in its order
        # zero3: frozen parameters gathered with them (see [Note: frozen parameters in a unit])
        self.frozen = list(frozen)
        self.members = list(params) + self.frozen
        self.sharded = sharded
        # zero3: the full flat buffer exists only while the unit computes (see [Note: zero3's
        # gather and free] in zero3.py); its storage is freed between uses, and the
        # master, the truth, has storage of its own.
        self.reshards = reshards
        self.gathered = True
        self.pending = None  # zero3: the all-gather of a prefetch, until someone waits on it
        # See [Note: a gradient reduced where autograd made it] in buckets.py, and
        # [Note: waiting for a reduction in backward] in reducer.py for `probe`.
        self.bucket = None
        if params:
            alone = len(params) == 1 and \
                params[0].numel() % (world * context.align if sharded else 1) == 0
            self.bucket = GradBucket(index, params, pad_to=world if sharded else 1,
                                     dtype=compute_dtype, pool=context.pool,
                                     tail_apart=policy.shards_grads(world) and (alone or reshards),
                                     align=context.align if sharded else 1)
        self.probe = None  # the tail's own collective, while the gradients' is in flight
        n = self.bucket.padded_numel if self.bucket is not None else 0
        shard = n // world if sharded else n
        self.lo, self.hi = (rank * shard, (rank + 1) * shard) if sharded else (0, n)
        # the frozen segment follows the trainable one, padded and sharded apart
        frozen_numel = -(-sum(p.numel() for p in self.frozen) // world) * world
        self.frozen_at = n
        self.flo = n + rank * frozen_numel // world
        self.fhi = self.flo + frozen_numel // world
        self.numel = n + frozen_numel  # of the full flat buffer
        self.offsets = list(self.bucket.offsets if self.bucket is not None else [])
        for p in self.frozen:
            self.offsets.append(n)
            n += p.numel()
        if self.frozen and not (reshards and sharded):
            raise ValueError("frozen parameters are held in units under zero3 only")
        self.master_dtype = self.members[0].dtype
        self.compute_dtype = compute_dtype
        self.grad_shard: torch.Tensor | None = None  # grads SHARD: the reduced owned slice
        self.reduced: torch.Tensor | None = None     # the owned reduced gradient, compute dtype
        self.used: list[bool] | None = None          # got a gradient on some rank (per param)
        self.nonfinite = False  # some rank flagged a non-finite loss (the bucket's signal)
        self.failed = False     # some rank's step raised (the signal: engine/vote.py)
        # The reduced flags and signal, on the device, until the end of backward reads them
        # with every other unit's (see `take_flags` below and host.py).
        self.tail: torch.Tensor | None = None
        self.flat: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.frozen_shard: torch.Tensor | None = None  # the owned slice of the frozen segment
        self.pieces: list[Piece] = []         # of the masters: what the optimizer steps
        self.frozen_pieces: list[Piece] = []  # of the frozen shard (param_index into members)
        self._received: torch.Tensor | None = None  # reduce-scatter's output, until finished
        self._sent_compressed = False
        if context.adopt:
            self._lay_out_flat()
        else:  # each parameter is its own master, whole
            self.pieces = [Piece.whole(p, i, o)
                           for i, (p, o) in enumerate(zip(params, self.bucket.offsets))]

    @property
    def master_is_view(self) -> bool:
        return self.compute_dtype == self.master_dtype and not self.reshards and self.host is None

    def owned(self, i: int) -> tuple[int, int, torch.Tensor]:
        """Member i's segment as (lo, hi, held): the owned range of the flat buffer, and the
        tensor that holds it between uses (the master, or the frozen shard)."""
        if i < len(self.params):
            return self.lo, self.hi, self.master
        return self.flo, self.fhi, self.frozen_shard

    def held(self) -> list[torch.Tensor]:
        """What this rank holds of the unit between uses: the master of the trainable segment,
        the shard of the frozen one (those that exist, in that order)."""
        return ([self.master] if self.params else []) + ([self.frozen_shard] if self.frozen else [])

    @torch.no_grad()
    def _lay_out_flat(self) -> None:
        n, device = self.numel, self.members[0].device
        if self.reshards:
            # zero3: only the owned slices are read and kept; the full buffer is never written
            # here (its pages are not touched) and is freed below, so building the engine takes
            # the shards and nothing more, however large the unit.
            self.flat = torch.empty(n, dtype=self.compute_dtype, device=device)
            self.master = self._zeros(self.hi - self.lo, self.master_dtype, self.host, device)
            if self.frozen:
                self.frozen_shard = self._zeros(self.fhi - self.flo, self.compute_dtype,
                                                self.shards_on_host, device)
            for i, (p, offset) in enumerate(zip(self.members, self.offsets)):
                lo, hi, held = self.owned(i)
                a, b = max(offset, lo), min(offset + p.numel(), hi)
                if a < b and _has_room(p):  # a meta build's come later (model/materialize.py)
                    held[a - lo:b - lo].copy_(p.detach().reshape(-1)[a - offset:b - offset])
            if self.host is not None and self.params:  # see [Note: offload] in offload.py
                same = self.shards_on_host and self.compute_dtype == self.master_dtype
                self.kept = self.master if same else self._zeros(
                    self.hi - self.lo, self.compute_dtype, self.shards_on_host, device)
                self.refresh_kept()
        else:
            full = torch.zeros(n, dtype=self.master_dtype, device=device)
            for p, offset in zip(self.params, self.offsets):
                full[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            # The master starts from the user's full-precision values, not a low-precision copy.
            self.flat = full if self.master_is_view else full.to(self.compute_dtype)
            if self.master_is_view:
                self.master = self.flat[self.lo:self.hi]
            else:
                self.master = self._zeros(self.hi - self.lo, self.master_dtype, self.host, device)
                self.master.copy_(full[self.lo:self.hi])
            del full
        for p, offset in zip(self.members, self.offsets):
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
        for i, (p, offset) in enumerate(zip(self.members, self.offsets)):
            lo, hi, held = self.owned(i)
            a, b = max(offset, lo), min(offset + p.numel(), hi)
            if a >= b:
                continue
            view = held[a - lo:b - lo]
            whole = (a, b) == (offset, offset + p.numel())
            if i < len(self.params) and b - a > PIECE_CAP:  # see [Note: a cap on a piece]
                for c in range(a, b, PIECE_CAP):
                    d = min(c + PIECE_CAP, b)
                    self.pieces.append(Piece(i, c - offset, d - offset,
                                             torch.nn.Parameter(held[c - lo:d - lo]),
                                             c - lo, d - lo))
            elif i < len(self.params):
                master = torch.nn.Parameter(view.view_as(p) if whole else view)
                self.pieces.append(Piece(i, a - offset, b - offset, master, a - lo, b - lo))
            else:  # no gradient, no optimizer: a plain view
                self.frozen_pieces.append(Piece(i, a - offset, b - offset,
                                                view.view_as(p) if whole else view,
                                                a - lo, b - lo))
        self.reshard()  # zero3: the full buffer's storage exists only while gathered

    def _zeros(self, numel: int, dtype: torch.dtype, on_host, device) -> torch.Tensor:
        """A tensor of its own, in host memory (offload.py) or on the device."""
        if on_host:
            return self.host.zeros(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=device)

    @torch.no_grad()
    def refresh_kept(self) -> None:
        """zero3 offloaded: `kept` (what the gathers start from) from the master, after the
        master was written (a load, a meta build's values)."""
        if self.kept is not None and self.kept is not self.master:
            self.kept.copy_(self.master)

    @torch.no_grad()
    def publish(self, link, staging: str) -> None:
        """After a step on the host (offload.py): the master into what the device computes
        from: the owned slice of the full buffer (zero1, zero2; all-gathered next), or `kept`
        (zero3: on the device, or on the host under offload="params", copied up at each
        gather)."""
        if self.shards_on_host:
            self.refresh_kept()
        else:
            link.upload(self.master, self.kept if self.reshards else self.flat[self.lo:self.hi],
                        staging)

    # -- the cache and the truth ---------------------------------------------------------------
    @torch.no_grad()
    def sync_master_from_cache(self) -> None:
        """Take values written into the parameters behind phalanx's back into the master, on
        the device alone (an element unchanged keeps its master value: nothing is read back to
        the host to decide whether anything changed)."""
        if self.flat is None or self.master_is_view or self.reshards or self.host is not None:
            return  # offloaded: the cache is on the device, the master on the host (offload.py)
        cache = self.flat[self.lo:self.hi]
        changed = cache != self.master.to(self.compute_dtype)
        changed &= ~(cache.isnan() & self.master.isnan())
        self.master.copy_(torch.where(changed, cache.to(self.master_dtype), self.master))

    @property
    def full_bytes(self) -> int:
        """What the full buffer takes while gathered."""
        return self.numel * self.flat.element_size() if self.flat is not None else 0

    def wait_gathered(self) -> None:
        """Wait for a prefetched all-gather, if one is on the wire."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()

    @torch.no_grad()
    def reshard(self) -> None:
        """Free the full buffer's storage (zero3); the parameters stay views of it, valid
        again after the next `unshard`. An all-gather still writing into it is waited for
        first."""
        if self.reshards and self.gathered and self.flat is not None:
            self.wait_gathered()
            self.flat.untyped_storage().resize_(0)
            self.gathered = False

    @torch.no_grad()
    def allocate(self) -> bool:
        """zero3: give the freed full buffer its storage back, unfilled, for values about to be
        written whole (a load through the user's module); True if it had none. `reshard()`
        frees it again."""
        if not self.reshards or self.flat is None:
            return False
        self.wait_gathered()
        if self.gathered:
            return False
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
        self.gathered = True
        return True

    @torch.no_grad()
    def unshard(self, comm, async_op: bool = True, written: bool = False):
        """Refresh the full compute-dtype buffer from the shards of every rank: the masters
        (cast; under offload `kept`, or what `publish` just wrote: `written`), and under zero3
        the frozen shards, each segment its own all-gather."""
        if self.flat is None:
            return None
        if not self.gathered:  # zero3: give the storage back its size, then fill it
            self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
            self.gathered = True
        if self.params and not self.master_is_view and not written:
            source = self.kept if self.kept is not None else self.master
            self.flat[self.lo:self.hi].copy_(source, non_blocking=True)
        if self.shards_on_host:  # offload="params": this rank's shards go up first
            mine = self.hi - self.lo + self.fhi - self.flo
            self.host.up_bytes += mine * self.flat.element_size()
        if not self.sharded:
            return None
        handles = []
        if self.params:
            handles.append(comm.all_gather_into(
                self.flat[:self.frozen_at], self.flat[self.lo:self.hi], async_op=async_op,
                tag=f"unit[{self.index}]:unshard"))
        if self.frozen:
            self.flat[self.flo:self.fhi].copy_(self.frozen_shard, non_blocking=True)
            handles.append(comm.all_gather_into(
                self.flat[self.frozen_at:], self.flat[self.flo:self.fhi], async_op=async_op,
                tag=f"unit[{self.index}]:unshard frozen"))
        if not async_op:
            return None
        if len(handles) == 1:
            return handles[0]
        return Handle([w for h in handles for w in h.works],
                      records=[r for h in handles for r in h.records])

    @torch.no_grad()
    def fill(self, values: torch.Tensor) -> None:
        """zero3: give the full buffer `values` (the whole unit, read from the peers by a rank
        acting alone; engine/remote.py) instead of gathering it."""
        if not self.gathered:
            self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
            self.gathered = True
        self.flat.copy_(values, non_blocking=True)

    @torch.no_grad()
    def standalone(self) -> None:
        """Give every member storage of its own again, zeros until its values are loaded (the
        unit's engine is being replaced: model/relayout.py): a trainable parameter in its own
        dtype, a frozen one of zero3's in the dtype it was cast to."""
        for p in self.members:
            dtype = self.master_dtype if p.requires_grad else self.compute_dtype
            p.data = torch.zeros(p.shape, dtype=dtype, device=p.device)
            p.grad = None

    @torch.no_grad()
    def load_master(self, values: list[torch.Tensor | None]) -> None:
        """Set the owned master (and frozen shard) from full-precision values of every member
        (None: keep)."""
        for piece in self.pieces + self.frozen_pieces:
            v = values[piece.param_index]
            if v is not None:
                piece.master.view(-1).copy_(v.reshape(-1)[piece.start:piece.end])
        self.refresh_kept()

    # -- gradients: reduced over the ranks, and turned into what the step reads -------------
    def reduce_grad(self, comm, comm_dtype: torch.dtype | None, shard: bool):
        """Start averaging the unit's bucket over the ranks (asynchronously): all of it, in
        place, where gradients stay full; to the owned shard where they are sharded (by
        reduce-scatter or by all-reduce, as the Comm prefers). The used-flags ride along, or
        go in a collective of their own beside the gradients' (a bucket whose tail is apart,
        or a reduce-scatter). A reduce-scatter writes straight into the owned gradient when
        nothing is accumulated there yet."""
        bucket = self.bucket
        buf = bucket.buffer
        self._sent_compressed = comm_dtype is not None and comm_dtype != buf.dtype
        if self._sent_compressed:
            buf = bucket.copy_for_comm(comm_dtype)
        tag = f"unit[{self.index}]:grads"
        self._received = None
        n = bucket.padded_numel
        if not (shard and (comm.uses_reduce_scatter or bucket.tail_apart)):
            return comm.all_reduce(buf, async_op=True, tag=tag)
        if comm.uses_reduce_scatter:
            if self.grad_shard is None:
                self.grad_shard = torch.empty(self.hi - self.lo, dtype=bucket.dtype,
                                              device=buf.device)
            into = self.reduced is None and buf.dtype == self.grad_shard.dtype
            self._received = self.grad_shard if into else \
                torch.empty(self.hi - self.lo, dtype=buf.dtype, device=buf.device)
            grads = comm.reduce_shard(buf[:n], self._received, tag=tag)
        else:
            grads = comm.all_reduce(buf[:n], async_op=True, tag=tag)
        tail = bucket.tail() if bucket.tail_apart else buf[n:]
        flags = comm.all_reduce(tail, async_op=True, tag=tag + ":flags")
        self.probe = flags if bucket.tail_apart else None
        return Handle(grads.works + flags.works, records=grads.records + flags.records)

    def finish_grad(self, shard: bool) -> None:
        """Turn the reduced bucket into what the step reads, once its collective is done, on
        the device alone: which parameters got a gradient is read by the host later, with
        every unit's, in `take_flags` (see host.py).

        See [Note: gradients that never arrived] in reducer.py: under full gradients a parameter
        still holding an accumulated `.grad` counts as used by itself (its slot is kept, its
        flag set); sharded gradients leave `.grad` None, so the flags of earlier backwards since
        zero_grad() are remembered in `take_flags`.
        """
        bucket = self.bucket
        reduced = bucket.comm_buffer if self._sent_compressed \
            else bucket.buffer
        if shard:
            tail = bucket.tail() if bucket.tail_apart else reduced[bucket.padded_numel:]
            self.tail = tail.clone()  # the bucket's buffer is about to go
            owned = self._received if self._received is not None \
                else reduced[self.lo:self.hi]
            self._received = self.probe = None
            if self.grad_shard is None:
                self.grad_shard = torch.empty(self.hi - self.lo, dtype=bucket.dtype,
                                              device=owned.device)
            # A second backward before zero_grad() accumulates, as in one process (on the
            # host where the shard went there: `offload_grad`).
            if owned is self.grad_shard:
                pass  # reduce-scattered into it
            elif self.reduced is None or self.host_filled:
                self.grad_shard.copy_(owned)
            else:
                self.grad_shard.add_(owned)
            self.reduced = self.grad_shard
            for p in self.params:
                p.grad = None
            bucket.free()
            return
        if reduced is not bucket.buffer:
            bucket.buffer.copy_(reduced)  # the mean, into every element: `.grad` is the mean
        # The bucket is kept and the parameters keep their views into it, so a second backward
        # accumulates into it in place (the mean of a sum already equal on every rank plus the
        # new gradients is that sum plus their mean).
        self.tail = bucket.tail()
        self.reduced = bucket.grads()[self.lo:self.hi]

    def take_flags(self, tail: list[float], shard: bool) -> None:
        """The host's part of finishing, given this unit's reduced flags and signal as read."""
        used, self.nonfinite = [f > 0 for f in tail[:-1]], tail[-1] > 0
        self.failed = tail[-1] >= FAILED_AT
        self.tail = None
        if shard:
            if self.used is not None:
                used = [a or b for a, b in zip(self.used, used)]
            self.used = used
            return
        self.used = used
        for i, p in enumerate(self.params):
            p.grad = self.bucket.view(i) if used[i] else None

    def set_piece_grads(self, grad: torch.Tensor | None) -> None:
        """Point every piece's `.grad` at its slice of `grad` (the owned reduced gradient in the
        master dtype), None for parameters that got no gradient on any rank."""
        for piece in self.pieces:
            if grad is None or not self.used[piece.param_index]:
                piece.master.grad = None
            else:
                piece.master.grad = grad[piece.lo:piece.hi].view_as(piece.master)

    def offload_grad(self, link) -> None:
        """offload="optimizer" under sharded gradients (offload.py's [Note: offload]): the
        reduced shard just made goes to the host (added there to what an earlier backward
        left since zero_grad), and its device memory is let go."""
        if self.host_grad is None:
            self.host_grad = link.zeros(self.hi - self.lo, self.grad_shard.dtype)
        link.keep_down(self.grad_shard, self.host_grad, add=self.host_filled)
        self.reduced = self.host_grad
        self.grad_shard = None
        self.host_filled = True

    def clear_reduced(self) -> None:
        self.reduced = None
        self.used = None
        self.host_filled = False


def _has_room(p: torch.Tensor) -> bool:
    """False for a parameter seen through a zero stride (a meta build's zero3 parameters before
    their shards are drawn): it holds no values to read."""
    return p.numel() <= 1 or 0 not in p.stride()
