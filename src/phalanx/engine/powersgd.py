"""PowerSGD inside the bucketed reducer: ddp, zero1 and zero2 send low-rank factors of the
gradients instead of the gradients (the request and its checks: powersgd_config.py).

Per unit (one bucket) and compressed reduction, for each compressed parameter, its gradient
seen as a matrix of n = shape[0] rows and m columns, on rank i:
  1. M_i = grad_i + e_i (e_i: this rank's error feedback), P = M_i Q, with Q (m x r) the
     previous reduction's (warm start) or drawn from a seed made of the parameter's position
     among the model's trainable parameters (and, without warm start, the reduction's count);
  2. ONE all-reduce (mean) carries every P of the bucket, the parameters that travel whole
     (vectors, and matrices that would not shrink by `min_compression`), and the bucket's
     used-flags and non-finite signal; it is waited for inside the launch;
  3. P is orthonormalized: a Householder QR (torch.linalg.qr), whose factor is orthonormal even
     when P is rank-deficient (a gradient of lower rank than r), where Gram-Schmidt would
     divide round-off by round-off;
  4. Q = M_i^T P; every Q of the bucket in a second all-reduce (mean), the asynchronous handle
     the reducer waits for as it would for an uncompressed bucket;
  5. once it is done, the bucket's slot of the parameter becomes P Q^T (zero where no rank gave
     the parameter a gradient: see [Note: gradients that never arrived] in reducer.py), and
     e_i = M_i - P Q^T.
The compressed matrices of a unit that share a shape form a group whose Ps, Qs, error
feedback and warm-start Qs lie side by side, so steps 1, 3, 4 and 5 are one batched call per
group (bmm, a batched QR) rather than one call per matrix; P Q^T is written straight into the
bucket, and e_i = M_i - P Q^T subtracts what was written there (baddbmm, a second product,
where the bucket is bf16). The time these take is in the step report
(`powersgd/compute_s`, beside the bytes saved).
The bucket then holds what an all-reduce would have left in it, and the rest of the engine
(flat.py's finish_grad: ddp's and zero1's `.grad`, zero2's owned shard of the full average) is
unchanged. The second round is issued from the launch, not from the wait, because every rank
must issue collectives in the same order ([Note: one launch order on every rank] in
reducer.py), and only the launches happen in the same order everywhere.

A reduction whose factors hold an inf or NaN (a non-finite loss skipped with
`on_nonfinite="skip"`) keeps the previous Q and clears the error feedback, which would carry
the inf or NaN into every later step.

[Note: PowerSGD's state depends only on means over ranks]
Every quantity the algorithm uses is linear in the M_i, and only their mean is ever used:
P = mean_i(M_i Q) = mean(M) Q, then Q' = mean_i(M_i^T P) = mean(M)^T P, the applied gradient
P Q'^T, and the new mean error mean(e') = mean(M) - P Q'^T. With mean(M) = mean(grad) + mean(e),
the run's trajectory (parameters, Q, mean error) depends on the ranks' gradients only through
their mean, which is the global batch's gradient at any world size. So a checkpoint keeps the
mean over ranks of the error feedback (one all-reduce at save) and the Q, by parameter name as
the optimizer state is kept ([Note: PowerSGD in a checkpoint] below); a resume at any world size
gives every rank that mean as its error feedback, and continues as the uninterrupted run would
have (in float64, to round-off: tests/test_powersgd.py). A world of one runs the same algorithm,
with collectives that move nothing, so one process on the global batch is the reference.
(torch's DDP hook keeps its state per bucket index, which no other bucket layout or world size
can read.)

[Note: PowerSGD in a checkpoint]
The compressor is a part of the engine (part.py), its state stored by parameter name, so it
loads at any world size and strategy as the optimizer state does:

    powersgd/reductions        how many gradient reductions ran (1 element): a resumed run
                               past `start_step` compresses from its first step
    powersgd/<param>/error     the MEAN over ranks of the parameter's error feedback, flat
    powersgd/<param>/q         its warm-start Q (columns x rank), flat

Only the mean of the error feedback is kept, and every rank of the resumed run starts from it
(see the Note above), so this resumes exactly, at any world size. The tensors are written by
one rank each, in turn. A checkpoint saved without PowerSGD loads into a model with it as a
fresh start (no error, Q drawn anew, the count at 0); a saved Q of another rank than the
loading run's is left out (drawn anew), the rest loads. A model prepared without PowerSGD
leaves that state out, and says nothing (its `left_out` is the default).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..comm.collectives import Handle
from .part import Part, Range, Saved
from .powersgd_config import PowerSGD

__all__ = ["PowerSGDReducer"]

_SEED = 0x5EED
_COUNT = "reductions"  # the count's key in a checkpoint (under powersgd/)


@dataclass(eq=False)
class _Matrix:
    """A compressed parameter of a unit."""
    index: int    # its position in the unit
    number: int   # its position among the engine's trainable parameters: names its state
    offset: int   # where its gradient starts in the bucket
    n: int        # rows (shape[0])
    m: int        # columns (the other dimensions, flattened)
    r: int        # columns of the factors
    group: "_Group | None" = None
    slot: int = 0  # its place in the group


class _Group:
    """The compressed matrices of a unit that have one shape (n, m, r). Their Ps lie side by
    side in the first buffer, their Qs in the second, and their error feedback and warm-start
    Qs in one tensor each, so that each of the two products, the orthogonalization and the
    error's update is one batched call for the group (bmm, a batched QR, baddbmm) instead of
    one call per matrix."""

    def __init__(self, members: list[_Matrix], p_at: int, q_at: int):
        self.members = members
        self.n, self.m, self.r = members[0].n, members[0].m, members[0].r
        self.p_at, self.q_at = p_at, q_at
        self.indices = torch.tensor([mat.index for mat in members])
        self.errors: torch.Tensor | None = None  # (B, n, m): every member's error feedback
        self.qs: torch.Tensor | None = None      # (B, m, r): every member's warm-start Q
        for slot, mat in enumerate(members):
            mat.group, mat.slot = self, slot

    def p_view(self, first: torch.Tensor) -> torch.Tensor:
        b = len(self.members)
        return first[self.p_at:self.p_at + b * self.n * self.r].view(b, self.n, self.r)

    def q_view(self, second: torch.Tensor) -> torch.Tensor:
        b = len(self.members)
        return second[self.q_at:self.q_at + b * self.m * self.r].view(b, self.m, self.r)


class _UnitPlan:
    """Which parameters of a unit are compressed, and where everything goes on the wire:
    first buffer [every P, group by group | the parameters sent whole | flags and signal],
    second [every Q, group by group]. The buffers are made at the first compressed reduction
    and kept (a fresh one each step would cost a page fault per 4 KiB on CPU)."""

    def __init__(self, unit, numbers: dict[int, int], config: PowerSGD):
        bucket = unit.bucket
        self.matrices: list[_Matrix] = []
        self.whole: list[tuple[int, int]] = []  # ranges of the bucket sent as they are
        shapes: dict[tuple, list[_Matrix]] = {}
        for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
            n = p.shape[0] if p.dim() >= 2 else 0
            m = p.numel() // n if n else 0
            r = min(config.rank, n, m)
            if r > 0 and n * m >= config.min_compression * (n + m) * r:
                mat = _Matrix(i, numbers[id(p)], offset, n, m, r)
                self.matrices.append(mat)
                shapes.setdefault((n, m, r), []).append(mat)
            elif self.whole and self.whole[-1][1] == offset:
                self.whole[-1] = (self.whole[-1][0], offset + p.numel())
            else:
                self.whole.append((offset, offset + p.numel()))
        self.groups: list[_Group] = []
        p_at = q_at = 0
        for (n, m, r), members in shapes.items():
            self.groups.append(_Group(members, p_at, q_at))
            p_at += len(members) * n * r
            q_at += len(members) * m * r
        self.p_numel = p_at
        self.tail_at = p_at + sum(b - a for a, b in self.whole)
        self.first_numel = self.tail_at + bucket.total_numel - bucket.padded_numel
        self.second_numel = q_at
        self.first: torch.Tensor | None = None
        self.second: torch.Tensor | None = None

    def buffers(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.first is None:
            self.first = torch.empty(self.first_numel, dtype=like.dtype, device=like.device)
            self.second = torch.empty(self.second_numel, dtype=like.dtype, device=like.device)
        return self.first, self.second


class PowerSGDReducer(Part):
    """The compressor of one engine: its plan per unit and its state per parameter.

    State, by the parameter's position among the engine's trainable parameters (the model's
    order, the same at any world size and strategy): `errors`, this rank's error feedback
    (n x m); `qs`, the warm-start Q (m x r), the same on every rank; `reductions`, how many
    gradient reductions ran (compression starts at `config.start_step`). A part of the engine
    (part.py): see [Note: PowerSGD in a checkpoint].
    """

    name = "powersgd"
    small_at = ("powersgd",)  # (it keeps no small values: the count is a tensor)

    def __init__(self, config: PowerSGD, units, params: list[torch.nn.Parameter]):
        self.config = config
        self.params = params
        numbers = {id(p): k for k, p in enumerate(params)}
        self.plans = [_UnitPlan(unit, numbers, config) for unit in units]
        self.matrices = {mat.number: mat for plan in self.plans for mat in plan.matrices}
        self.reductions = 0
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}
        self._sent = self._dense = 0  # bytes since the last step report
        self._compute_s = 0.0  # seconds computing since the last step report

    @property
    def compressing(self) -> bool:
        return self.reductions >= self.config.start_step

    def backward_done(self) -> None:
        """The end of a backward that reduced gradients (every rank counts the same)."""
        self.reductions += 1

    # -- one unit's reduction ---------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, unit, comm) -> Handle | None:
        """Start the compressed reduction of `unit`'s bucket (see the module's docstring);
        None when the unit goes uncompressed (before start_step, or nothing to compress)."""
        plan = self.plans[unit.index]
        bucket = unit.bucket
        buf = bucket.buffer
        dense = bucket.total_numel * buf.element_size()
        if not (self.compressing and plan.matrices):
            self._count(comm, dense, dense)
            return None
        began = time.perf_counter()
        first, second = plan.buffers(buf)
        work = torch.promote_types(buf.dtype, torch.float32)  # fp32 math for a bf16 bucket
        ms = []
        for group in plan.groups:
            m = self._m(group, buf, work)  # the error buffers, holding M until finished
            ms.append(m)
            # P = M Q, computed as (Q^T M^T)^T: the same product, 4x faster on one CPU thread
            # for the tall-and-thin shapes here (one pass along M's rows instead of strided)
            q = self._q(group, work, buf.device)
            group.p_view(first).copy_(torch.bmm(q.transpose(1, 2),
                                                m.transpose(1, 2)).transpose(1, 2))
        at = plan.p_numel
        for a, b in plan.whole:
            first[at:at + b - a].copy_(buf[a:b])
            at += b - a
        first[plan.tail_at:].copy_(bucket.tail())
        self._compute_s += time.perf_counter() - began
        comm.all_reduce(first, tag=f"unit[{unit.index}]:powersgd:P")
        began = time.perf_counter()
        at = plan.p_numel
        for a, b in plan.whole:
            buf[a:b].copy_(first[at:at + b - a])
            at += b - a
        bucket.tail().copy_(first[plan.tail_at:])
        # a Householder QR, batched over the group (see the module's docstring)
        ps = [torch.linalg.qr(group.p_view(first).to(work))[0] for group in plan.groups]
        for group, m, p in zip(plan.groups, ms, ps):
            # Q = M^T P as (P^T M)^T, for the same reason (about 8x here)
            group.q_view(second).copy_(torch.bmm(p.transpose(1, 2), m).transpose(1, 2))
        self._compute_s += time.perf_counter() - began
        handle = comm.all_reduce(second, async_op=True, tag=f"unit[{unit.index}]:powersgd:Q")
        self._count(comm, dense, (first.numel() + second.numel()) * first.element_size())
        return Handle(handle.works, then=lambda: self._finish(unit, plan, ms, ps),
                      records=handle.records)

    @torch.no_grad()
    def _finish(self, unit, plan: _UnitPlan, ms: list, ps: list) -> None:
        """Once the Qs are averaged: the approximations into the bucket, the state updated,
        all on the device (nothing is read back to the host from a GPU)."""
        began = time.perf_counter()
        buf = unit.bucket.buffer
        first, second = plan.first, plan.second
        flags = first[plan.tail_at:plan.tail_at + len(unit.params)]
        finite = torch.isfinite(first[:plan.tail_at]).all() & torch.isfinite(second).all()
        for group, m, p in zip(plan.groups, ms, ps):
            q = group.q_view(second).to(p.dtype)
            used = flags[group.indices.to(flags.device)] > 0
            p = p * used[:, None, None]  # a parameter no rank gave a gradient gets zero
            same = buf.dtype == p.dtype
            for mat in group.members:
                view = buf[mat.offset:mat.offset + mat.n * mat.m].view(mat.n, mat.m)
                if same:
                    torch.mm(p[mat.slot], q[mat.slot].T, out=view)
                    if self.config.error_feedback:  # M - P Q^T, from the P Q^T just written
                        m[mat.slot].sub_(view)  # (one pass, where a second product took two)
                else:
                    view.copy_(p[mat.slot] @ q[mat.slot].T)
            if self.config.error_feedback:  # m is the error buffers, holding M: M - P Q^T
                if not same:
                    m.baddbmm_(p, q.transpose(1, 2), alpha=-1)
                _zero_unless(m, finite)
            if self.config.warm_start:
                keep = (used & finite)[:, None, None]
                group.qs.copy_(torch.where(keep, q, group.qs))
        self._compute_s += time.perf_counter() - began

    # -- state ----------------------------------------------------------------------------------
    def _m(self, group: _Group, buf: torch.Tensor, work) -> torch.Tensor:
        """M of every member (B x n x m): the error feedback plus the gradient, in the error
        buffers; without error feedback, the gradients stacked."""
        grads = [buf[mat.offset:mat.offset + mat.n * mat.m].view(mat.n, mat.m)
                 for mat in group.members]
        if not self.config.error_feedback:
            return torch.stack(grads).to(work)
        errors = self._errors(group, work, buf.device)
        for mat, grad in zip(group.members, grads):
            errors[mat.slot].add_(grad)
        return errors

    def _errors(self, group: _Group, dtype, device) -> torch.Tensor:
        if group.errors is None:
            group.errors = torch.zeros(len(group.members), group.n, group.m, dtype=dtype,
                                       device=device)
            for mat in group.members:
                self.errors[mat.number] = group.errors[mat.slot]
        return group.errors

    def _q(self, group: _Group, dtype, device) -> torch.Tensor:
        """Q of every member for this reduction: the last one where warm, else drawn from a
        seed that every rank, every world size and a resumed run make alike."""
        if self.config.warm_start and group.qs is not None:
            return group.qs
        qs = torch.empty(len(group.members), group.m, group.r, dtype=dtype, device=device)
        for mat in group.members:
            seed = _SEED + 7919 * mat.number
            if not self.config.warm_start:
                seed += 1_000_003 * self.reductions
            g = torch.Generator().manual_seed(seed)
            qs[mat.slot].copy_(torch.randn(mat.m, mat.r, generator=g, dtype=dtype))
        if self.config.warm_start:
            group.qs = qs
            for mat in group.members:
                self.qs[mat.number] = qs[mat.slot]
        return qs

    @torch.no_grad()
    def mean_errors(self, comm) -> dict[int, torch.Tensor]:
        """number -> the mean over ranks of its error feedback: a collective (every rank has
        the same errors, made at the same reduction), one all-reduce per dtype."""
        out = {}
        numbers = sorted(self.errors)
        for dtype in sorted({self.errors[k].dtype for k in numbers}, key=str):
            mine = [k for k in numbers if self.errors[k].dtype == dtype]
            flat = torch.cat([self.errors[k].reshape(-1) for k in mine])
            comm.all_reduce(flat, tag="powersgd:mean errors")
            at = 0
            for k in mine:
                n = self.errors[k].numel()
                out[k] = flat[at:at + n].view_as(self.errors[k])
                at += n
        return out

    def forget(self) -> None:
        """Drop the error feedback and the warm-start Qs: the state of a fresh start."""
        self.errors.clear()
        self.qs.clear()
        for plan in self.plans:
            for group in plan.groups:
                group.errors = group.qs = None

    @torch.no_grad()
    def load_param(self, number: int, error: torch.Tensor | None,
                   q: torch.Tensor | None) -> None:
        """Set a parameter's state from a checkpoint (flat values; None: leave as is). The
        same error is given to every rank: see [Note: PowerSGD's state depends only on means
        over ranks]."""
        mat = self.matrices[number]
        p = self.params[number]
        dtype = torch.promote_types(p.dtype, torch.float32)
        if error is not None and self.config.error_feedback:
            self._errors(mat.group, dtype, p.device)[mat.slot].copy_(error.view(mat.n, mat.m))
        if q is not None and self.config.warm_start:
            self._q(mat.group, dtype, p.device)[mat.slot].copy_(q.view(mat.m, mat.r))

    # -- a checkpoint: [Note: PowerSGD in a checkpoint] --------------------------------------
    @torch.no_grad()
    def state(self, saving) -> Saved:
        """This rank's share of the state to save; a collective (the mean of the errors)."""
        comm = saving.comm
        errors = self.mean_errors(comm)
        tensors = {_COUNT: torch.tensor([self.reductions], dtype=torch.int64)}
        for number, p in enumerate(self.params):
            name = saving.names.get(id(p))
            if name is None:
                continue
            if number in errors:
                tensors[f"{name}/error"] = errors[number]
            if number in self.qs:
                tensors[f"{name}/q"] = self.qs[number]
        out = []
        for i, (key, value) in enumerate(tensors.items()):  # the same order on every rank
            if i % comm.world == comm.rank:
                values = value.detach().reshape(-1)
                out.append(Range(key, 0, values.numel(), values))
        return Saved(out)

    @torch.no_grad()
    def load(self, loading) -> None:
        """The saved state of the parameters loaded (every rank reads the same: the mean
        error, the Q, the count)."""
        saved = set(loading.keys())
        if _COUNT not in saved:
            return
        self.reductions = int(loading.read(_COUNT, 0, 1)[0])
        for number, p in enumerate(self.params):
            name = loading.names.get(id(p))
            mat = self.matrices.get(number)
            if name not in loading.loaded or mat is None:
                continue
            error, q = f"{name}/error", f"{name}/q"
            self.load_param(
                number,
                loading.read(error, 0, p.numel()) if error in saved else None,
                loading.read(q, 0, mat.m * mat.r)
                if q in saved and loading.numel(q) == mat.m * mat.r else None)

    # -- the step report ------------------------------------------------------------------------
    def _count(self, comm, dense: int, sent: int) -> None:
        if comm.world > 1:
            self._dense += dense
            self._sent += sent

    def step_report(self) -> dict:
        """What compression cost and saved in the gradient reductions since the last report:
        'powersgd/bytes' (what they handed to collectives, as their records count them),
        'powersgd/dense_bytes' (what they would have sent uncompressed), their ratio
        'powersgd/compression' (1.0 before start_step), 'powersgd/saved_bytes' (the
        difference), and 'powersgd/compute_s', the time spent computing the factors, the
        approximations and the error feedback (host time: on a GPU, the time to launch
        them)."""
        sent, dense, compute = self._sent, self._dense, self._compute_s
        self._sent = self._dense = 0
        self._compute_s = 0.0
        return {"powersgd/bytes": sent, "powersgd/dense_bytes": dense,
                "powersgd/compression": dense / sent if sent else 1.0,
                "powersgd/saved_bytes": dense - sent, "powersgd/compute_s": compute}


def _zero_unless(t: torch.Tensor, finite: torch.Tensor) -> None:
    """Zero `t` where `finite` (a one-element bool tensor) is False: on the host by reading
    it, on a GPU by a masked fill (reading it would wait for the device)."""
    if t.device.type == "cpu":
        if not bool(finite):
            t.zero_()
    else:
        t.masked_fill_(~finite, 0.0)
