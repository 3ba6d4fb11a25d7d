"""DiLoCo's outer step: every H inner steps, average the pseudo-gradient and step the weights
that all ranks share (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training
of Language Models", arXiv:2311.08105); and its streaming form, which syncs the model in
fragments, one at a time, while the inner steps go on (Douillard et al. 2025, "Streaming
DiLoCo with overlapping communication", arXiv:2501.18512).

[Note: inner and outer steps]
Under DiLoCo every rank trains its own replica with the user's optimizer (the inner one) and
communicates nothing: the engine behind the model is a ddp engine over a world of one
(model/diloco.py), so `.grad` is this rank's own gradient, `px.no_sync` and accumulation work
as ever, and `px.clip_grad_norm_` clips by this rank's own norm. After every `sync_every`-th
`optimizer.step()` the ranks meet once:

    delta_r   = synced - weights_r          the pseudo-gradient of rank r (a descent
                                            direction written as a gradient: synced minus now,
                                            not now minus synced)
    delta     = mean over ranks of delta_r  one all-reduce, in `comm_dtype` if set
                                            (engine/diloco_wire.py: quantized, error feedback)
    synced    = outer_sgd(synced, grad=delta)   lr, momentum, Nesterov
    weights_r = synced                      on every rank alike

`synced` is the weights at the last sync, in the masters' dtype (fp32 under bf16 compute), and
the outer optimizer is a `torch.optim.SGD` over those tensors, so its momentum is an ordinary
`momentum_buffer` per parameter. With `sync_every=1`, outer lr 1, no outer momentum and an inner
SGD without momentum, `synced - mean(delta_r)` is the ddp step on the mean gradient.

[Note: streaming DiLoCo's schedule]
With `fragments=P` the trainable parameters are cut, in the model's order, into P runs of about
equal size (fragment_of), and the fragments are synced in turn, one every E = H / P steps, so
each fragment is synced once every H steps and the link carries 1/P of the model at a time.
`inner_steps` is the position in the cycle of H: after the step that makes it c,
  - a fragment sent D = `delay` steps before (c = its send + D, mod H) is applied: the outer
    step of its parameters with the average that arrived, and weights_r of those parameters
    become lerp(synced, weights_r, keep_local) (keep_local 0: the synced weights; the inner
    steps made on them while the average travelled are then dropped);
  - when c is a multiple of E, fragment (c / E - 1) mod P is sent: its delta_r is taken now
    and its average started on a process group of its own, waited for D steps later (at once
    when D is 0); at c = 0 the buffers are averaged too (below).
One fragment is in flight at a time (D < E). With P = 1 and D = 0 this is plain DiLoCo.

Buffers (BatchNorm's running statistics) are each rank's own between syncs; at the end of each
cycle (c = 0) the floating ones are averaged over the ranks and the others (a step count) take
rank 0's values, so right after a plain DiLoCo sync every rank holds the same parameters and
buffers.

[Note: a DiLoCo checkpoint]
DiLoCo's outer step is a part of the prepared model (part.py). Between two syncs every rank's
weights and inner optimizer state are its own, so a checkpoint holds:
  model/<name>                          the weights of the last sync (the weights every rank
                                        shares): what `px.export`, a load into a model prepared
                                        under another strategy, or a plain module gets;
  diloco/outer/<name>/momentum_buffer   the outer SGD's momentum (written once, every rank
                                        holds the same);
  diloco/rank<r>/model/<name>           rank r's own weights at the save;
  diloco/rank<r>/optim/<name>/<key>     rank r's own inner optimizer state (Adam's moments);
  diloco/rank<r>/error/<name>           rank r's error feedback (a comm_dtype that rounds);
  diloco/outer/<name>/in_flight         streaming: the average of the fragment sent and not
                                        applied yet, for that fragment's parameters (waited
                                        for at the save; the same on every rank);
  the position in the cycle of sync_every steps (`inner_steps`: the steps since the sync under
  plain DiLoCo) and the schedule (sync_every, fragments, delay, keep_local), in the small
  state.
The inner optimizer's state under `optim/` is, as under ddp, that of the rank that writes each
parameter, for loads into a model that is not DiLoCo.

A load restores the synced weights and the outer momentum on every rank. Then:
  - at the world size of the save, each rank takes back its own weights, inner optimizer
    state, error feedback, the position in the cycle and the average in flight (applied when
    it is due), so the run goes on exactly as if it had not stopped, wherever in the interval
    it was saved;
  - at another world size, the run resumes from the last sync: the average in flight is
    applied to the synced weights, every rank's weights are the synced ones, the count starts
    again at 0, rank r takes saved rank (r mod N)'s inner optimizer state (N: the world size
    of the save), and every rank the mean of the saved ranks' error feedback (what the
    average still owes them). The inner steps made since the sync are lost, and a warning
    says so: under plain DiLoCo how many (a save right after a sync loses none); under
    streaming (fragments, a delay or keep_local) each rank's weights always hold steps made
    since some fragment's sync. Where the algorithm does not depend on the world size
    (sync_every=1 with an inner SGD without state, the pseudo-gradient then being the
    learning rate times the mean gradient) the resumed run equals the uninterrupted one.
A load into a model that is not DiLoCo (prepared under another strategy) takes the synced
weights under model/ and the inner optimizer state under optim/, and nothing else: rank 0
warns, naming what is left out (the inner steps since the sync, the outer momentum, an
average in flight, the error feedback) and that a model prepared with the px.DiLoCo of the
save keeps it. A plain module loaded without an optimizer (an evaluation; what px.export
writes) takes the synced weights without a warning.
"""

from __future__ import annotations

import torch

from .diloco_wire import Exchange, Wire
from .optim import per_element
from .part import Part, Range, Saved

__all__ = ["OuterSync", "fragment_of"]


def fragment_of(sizes: list[int], parts: int) -> list[list[int]]:
    """The indices of `sizes` cut into `parts` consecutive runs of about equal total (each one
    at least one index): a run ends once it reaches its share of the total."""
    total = sum(sizes)
    out: list[list[int]] = [[]]
    acc = 0
    for i, n in enumerate(sizes):
        left, opening = len(sizes) - i, parts - len(out)
        if out[-1] and opening > 0 and (acc >= len(out) * total / parts or left == opening):
            out.append([])
        out[-1].append(i)
        acc += n
    return out


class _InFlight:
    """A fragment whose average was started (or read from a checkpoint)."""

    def __init__(self, fragment: int, due: int, exchange: Exchange | None, deltas: list):
        self.fragment = fragment
        self.due = due             # the value of inner_steps after which it is applied
        self.exchange = exchange   # None: the average is in `deltas` already
        self.deltas = deltas       # the fragment's pseudo-gradients, then their average

    def averaged(self) -> list[torch.Tensor]:
        if self.exchange is not None:
            self.exchange.wait()
        return self.deltas


class OuterSync(Part):
    """The outer state of a DiLoCo model and its steps (see the Notes above)."""

    name = "diloco"                          # [Note: a DiLoCo checkpoint]
    small_at = ("stateful", "model.diloco")  # the count of inner steps, the schedule

    def __init__(self, config, engine, module: torch.nn.Module, comm):
        self.config = config
        self.comm = comm  # the job's Comm: the outer steps are the only communication
        self.engine = engine
        self.params = list(engine.params)
        pieces = engine.master_pieces()
        # What each inner step updates: the parameter itself, or its fp32 master under bf16
        # (the local engine never shards, so each is one whole piece).
        self.masters = [pieces[id(p)][0].master for p in self.params]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        with torch.no_grad():
            self.synced = [torch.nn.Parameter(m.detach().clone(), requires_grad=False)
                           for m in self.masters]
        momentum = float(config.outer_momentum)
        self.outer = torch.optim.SGD(self.synced, lr=config.outer_lr, momentum=momentum,
                                     nesterov=bool(config.nesterov) and momentum > 0)
        self.buffers = [b for b in module.buffers()]
        self.fragments = fragment_of([p.numel() for p in self.params], config.fragments)
        self.every = config.sync_every // config.fragments  # steps between two sends
        # An average that arrives steps later travels on a group of its own, so that nothing
        # issued on the job's group meanwhile queues behind it.
        self.wire_comm = comm.apart("diloco:outer") if config.delay and comm.world > 1 \
            else comm
        self.wire = Wire(self.wire_comm, config.comm_dtype, config.error_feedback)
        self.in_flight: _InFlight | None = None
        self._deltas: dict[int, list[torch.Tensor]] = {}  # fragment -> its pseudo-gradients
        self.inner_steps = 0  # the position in the cycle of sync_every steps (the same on
        self.syncs = 0        # every rank); fragments sent so far

    def groups(self) -> list:
        """The process groups the outer steps issue on (for the step report)."""
        return [c.group for c in {id(c): c for c in (self.comm, self.wire_comm)}.values()
                if c.group is not None]

    def send_step(self, fragment: int) -> int:
        """The value of inner_steps after which `fragment` is sent."""
        return (fragment + 1) * self.every % self.config.sync_every

    def after_step(self) -> None:
        """After every `optimizer.step()`: count it, apply what is due, send what is next."""
        self.inner_steps = (self.inner_steps + 1) % self.config.sync_every
        if self.in_flight is not None and self.in_flight.due == self.inner_steps:
            self.apply()
        if self.inner_steps % self.every == 0:
            self.send((self.inner_steps // self.every - 1) % self.config.fragments)
            if self.config.delay == 0:
                self.apply()
            if self.inner_steps == 0:
                self._sync_buffers()

    @torch.no_grad()
    def send(self, fragment: int) -> None:
        """Take the fragment's pseudo-gradients and start their average."""
        self.engine.master_pieces()  # takes edits made behind phalanx's back into the masters
        members = self.fragments[fragment]
        deltas = self._deltas.get(fragment)
        if deltas is None:  # kept: a fresh one each sync costs a page fault per 4 KiB on CPU
            deltas = self._deltas[fragment] = [torch.empty_like(self.synced[i]) for i in members]
        for i, d in zip(members, deltas):
            torch.sub(self.synced[i], self.masters[i], out=d)
        exchange = self.wire.start(members, deltas, f"diloco:fragment[{fragment}]")
        due = (self.inner_steps + self.config.delay) % self.config.sync_every
        self.in_flight = _InFlight(fragment, due, exchange, deltas)
        self.syncs += 1

    @torch.no_grad()
    def apply(self, keep_local: float | None = None) -> None:
        """The outer step of the fragment in flight with its average, and its weights on this
        rank from the new synced ones (see [Note: streaming DiLoCo's schedule])."""
        flight, self.in_flight = self.in_flight, None
        members = self.fragments[flight.fragment]
        for i, d in zip(members, flight.averaged()):
            self.synced[i].grad = d
        self.outer.step()  # steps only the parameters given a gradient
        keep = self.config.keep_local if keep_local is None else keep_local
        for i in members:
            s, m = self.synced[i], self.masters[i]
            s.grad = None
            if keep == 0:
                m.copy_(s)
            else:  # element by element, so m may be both an input and the output
                torch.lerp(s, m, keep, out=m)
        self.engine.publish_masters()  # bf16: the parameters from the masters (no collective)

    @torch.no_grad()
    def restore(self, weights: list[torch.Tensor] | None, inner_steps: int,
                in_flight: tuple[int, list[torch.Tensor]] | None = None) -> None:
        """After a load: `synced` holds the loaded weights already; this rank's weights become
        `weights` (None: the synced ones), the position in the cycle `inner_steps`, and
        `in_flight` (fragment, its average) the fragment whose average arrived but is not
        applied yet. Without `weights` that average is applied now (the run resumes from the
        synced weights)."""
        self.in_flight = None
        for i, m in enumerate(self.masters):
            m.copy_(self.synced[i] if weights is None else weights[i])
        self.engine.publish_masters()
        self.inner_steps = inner_steps
        if in_flight is not None:
            fragment, average = in_flight
            due = (self.send_step(fragment) + self.config.delay) % self.config.sync_every
            self.in_flight = _InFlight(fragment, due, None, average)
            if weights is None:
                self.apply(keep_local=0.0)

    def pending_average(self) -> tuple[int, list[torch.Tensor]] | None:
        """(fragment, its average) of the fragment in flight, waited for (a checkpoint keeps
        it: [Note: a DiLoCo checkpoint]); None when none is."""
        if self.in_flight is None:
            return None
        return self.in_flight.fragment, self.in_flight.averaged()

    def _sync_buffers(self) -> None:
        if self.comm.world == 1 or not self.buffers:
            return
        floating = [b for b in self.buffers if b.is_floating_point()]
        others = [b for b in self.buffers if not b.is_floating_point()]
        if floating:
            by_dtype: dict = {}
            for b in floating:
                by_dtype.setdefault(b.dtype, []).append(b)
            for members in by_dtype.values():
                flat = torch.cat([b.reshape(-1) for b in members])
                self.comm.all_reduce(flat, op="avg", tag="diloco:buffers")
                offset = 0
                for b in members:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
        for b in others:
            self.comm.broadcast(b, src=0, tag="diloco:buffers")

    # -- what a checkpoint holds: [Note: a DiLoCo checkpoint] ----------------------------------
    def momentum_of(self, i: int) -> torch.Tensor | None:
        return self.outer.state.get(self.synced[i], {}).get("momentum_buffer")

    @torch.no_grad()
    def set_momentum(self, i: int, value: torch.Tensor | None) -> None:
        state = self.outer.state[self.synced[i]]
        if value is None:
            state.pop("momentum_buffer", None)
        else:
            state["momentum_buffer"] = value.to(self.synced[i].dtype).clone()

    def error_of(self, i: int) -> torch.Tensor | None:
        """This rank's error feedback of parameter i (None before any lossy send)."""
        return self.wire.errors.get(i)

    @torch.no_grad()
    def set_error(self, i: int, value: torch.Tensor | None) -> None:
        if value is None:
            self.wire.errors.pop(i, None)
        else:
            self.wire.errors[i] = value.to(self.synced[i].dtype).view_as(self.synced[i]).clone()

    def model_values(self) -> dict[int, torch.Tensor]:
        """The model's trained parameters are saved as the weights of the last sync, which
        every rank shares (see the Note)."""
        return {id(p): self.synced[i] for i, p in enumerate(self.params)}

    @torch.no_grad()
    def state(self, saving) -> Saved:
        """This rank's DiLoCo ranges, and the position in the cycle with the schedule, which
        says what a resume from the synced weights loses (see the Note)."""
        rank, optimizer = saving.comm.rank, saving.optimizer
        out = []
        in_flight = self.pending_average()
        averages = {} if in_flight is None else dict(zip(self.fragments[in_flight[0]],
                                                         in_flight[1]))
        for i, p in enumerate(self.params):
            name = saving.names.get(id(p))
            if name is None:
                continue
            momentum = self.momentum_of(i)
            if momentum is not None and saving.writes(name):
                out.append(Range(f"outer/{name}/momentum_buffer", 0, p.numel(),
                                 momentum.detach().reshape(-1), like=name))
            if i in averages and saving.writes(name):
                out.append(Range(f"outer/{name}/in_flight", 0, p.numel(),
                                 averages[i].detach().reshape(-1), like=name))
            out.append(Range(f"rank{rank}/model/{name}", 0, p.numel(),
                             self.masters[i].detach().reshape(-1), like=name))
            error = self.error_of(i)
            if error is not None:
                out.append(Range(f"rank{rank}/error/{name}", 0, p.numel(),
                                 error.detach().reshape(-1), like=name))
            if optimizer is None:
                continue
            master = self.masters[i]
            for key, value in optimizer.state.get(master, {}).items():
                if per_element(key, value, master.shape):
                    out.append(Range(f"rank{rank}/optim/{name}/{key}", 0, p.numel(),
                                     value.detach().reshape(-1), like=name))
        config = self.config
        small = {"inner_steps": self.inner_steps, "sync_every": config.sync_every,
                 "fragments": config.fragments, "delay": config.delay,
                 "keep_local": float(config.keep_local)}
        return Saved(out, small)

    @torch.no_grad()
    def load(self, loading) -> None:
        """After the model (and optimizer) were loaded: the outer state (see the Note). A
        checkpoint saved without DiLoCo starts the outer state afresh from its weights."""
        rank, world = loading.comm.rank, loading.comm.world
        saved_world = loading.world_size
        same = saved_world == world
        tensors = set(loading.keys())
        own = f"rank{rank % saved_world}"
        mine, averages = [], {}
        for i, p in enumerate(self.params):
            name = loading.names.get(id(p))
            if name is None:
                continue
            self.synced[i].copy_(self.masters[i])  # model/<name>: the synced weights
            key = f"outer/{name}/momentum_buffer"
            self.set_momentum(i, loading.read(key, 0, p.numel()).view(p.shape)
                              if key in tensors else None)
            key = f"outer/{name}/in_flight"
            if key in tensors:
                averages[i] = loading.read(key, 0, p.numel()).view(p.shape).to(
                    self.synced[i].dtype)
            key = f"{own}/model/{name}"
            mine.append(loading.read(key, 0, p.numel()).view(p.shape)
                        if same and key in tensors else None)
            self.set_error(i, _saved_error(loading, tensors, name, p.numel(), rank,
                                           saved_world, same))
            if loading.optimizer is None:
                continue
            master = self.masters[i]
            prefix = f"{own}/optim/{name}/"
            for state_key, value in loading.optimizer.state.get(master, {}).items():
                if prefix + state_key in tensors and per_element(state_key, value,
                                                                 master.shape):
                    loading.read_into(prefix + state_key, 0, p.numel(), value)
        saved = loading.small or {}
        steps = int(saved.get("inner_steps", 0))
        in_flight = self._saved_in_flight(averages)
        if same and all(m is not None for m in mine):
            self.restore(mine, steps, in_flight)
            return
        self.restore(None, 0, in_flight)
        if rank != 0:
            return
        if _streaming(saved):
            loading.warn(f"px.load: this DiLoCo checkpoint was saved {steps} steps into a "
                         f"cycle of {saved.get('sync_every')} at world size {saved_world} "
                         f"(streaming); at world size {world} the run resumes from each "
                         "fragment's last sync, and the inner steps each rank made since are "
                         "not in it (resume at the same world size to lose none)")
        elif steps:
            loading.warn(f"px.load: this DiLoCo checkpoint was saved {steps} inner step(s) "
                         f"after a sync at world size {saved_world}; at world size {world} the "
                         "run resumes from that sync and those steps are not in it (save right "
                         "after a sync, or resume at the same world size, to lose none)")

    def _saved_in_flight(self, averages: dict) -> tuple | None:
        """(fragment, its averages) from the `in_flight` tensors read, or None."""
        if not averages:
            return None
        for k, members in enumerate(self.fragments):
            if set(members) == set(averages):
                return k, [averages[i] for i in members]
        raise ValueError("px.load: this DiLoCo checkpoint holds the average of a fragment in "
                         "flight whose parameters are no fragment of this model's DiLoCo: load "
                         "it with the fragments= it was saved with (or load a checkpoint saved "
                         "with no fragment in flight, e.g. right after a fragment was applied)")

    @classmethod
    def left_out(cls, loading) -> None:
        """After a DiLoCo checkpoint was loaded into a model that is not DiLoCo: on rank 0, a
        warning naming what the load left out, if anything (see the Note)."""
        saved = loading.small
        if saved is None or loading.comm.rank != 0 or \
                (not loading.prepared and loading.optimizer is None):
            return
        keys = loading.keys()
        lost = _steps_lost(saved)
        left = [lost] if lost is not None else []
        for suffix, what in (("/momentum_buffer", "the outer momentum"),
                             ("/in_flight", "a fragment's average in flight (sent, not applied)")):
            if any(k.startswith("outer/") and k.endswith(suffix) for k in keys):
                left.append(what)
        if any(k.startswith("rank") and "/error/" in k for k in keys):
            left.append("each rank's error feedback")
        if not left:
            return
        what = left[-1] if len(left) == 1 else ", ".join(left[:-1]) + " and " + left[-1]
        loading.warn(f"px.load: this checkpoint was saved under px.DiLoCo (world size "
                     f"{loading.world_size}) and the model it is loaded into is not DiLoCo: it "
                     f"takes the weights of the last sync and leaves out {what}. To go on from "
                     "where the run stopped, load it into a model prepared with the px.DiLoCo "
                     "it was saved with, at the same world size")


def _streaming(saved: dict) -> bool:
    """Whether the checkpoint's DiLoCo streams (fragments, a delay or keep_local): then each
    rank's weights always hold inner steps made since some fragment's sync, where plain
    DiLoCo's are the synced ones right after each sync. (A checkpoint of an older phalanx
    records no schedule: plain.)"""
    return saved.get("fragments", 1) != 1 or bool(saved.get("delay")) or \
        bool(saved.get("keep_local"))


def _steps_lost(saved: dict) -> str | None:
    """The inner steps a resume from the synced weights loses, in words; None: none."""
    steps = int(saved.get("inner_steps", 0))
    if _streaming(saved):
        return (f"the inner steps each rank made since each fragment's last sync (the save "
                f"was {steps} steps into a cycle of {saved.get('sync_every')})")
    return f"the {steps} inner step(s) each rank made since the last sync" if steps else None


def _saved_error(loading, tensors: set, name: str, numel: int, rank: int, saved_world: int,
                 same: bool):
    """This rank's error feedback at the load: its own at the same world size, else the mean
    of the saved ranks' (see the Note); None where none was saved."""
    if same:
        key = f"rank{rank}/error/{name}"
        return loading.read(key, 0, numel) if key in tensors else None
    keys = [f"rank{r}/error/{name}" for r in range(saved_world)]
    if not all(k in tensors for k in keys):
        return None
    total = loading.read(keys[0], 0, numel).clone()
    for key in keys[1:]:
        total += loading.read(key, 0, numel)
    return total / saved_world
