"""Offload: the masters and the optimizer state in host memory, stepped there.

[Note: offload]
`px.prepare(..., offload="optimizer")` moves the `masters` place of the strategy's row to the
host (policy.py): each rank's masters (the fp32 truth of the shard it steps) are host tensors,
pinned where CUDA exists, so the optimizer makes its state there too, and the step runs on the
host's cores. What the device keeps: the compute-dtype parameters (under zero1 and zero2 the
full ones, under zero3 its shard, `FlatUnit.kept`), zero3's frozen shards, and the gradients
while they are made and reduced. `offload="params"` (zero3 only) also moves the `shards` place: the
compute-dtype shard and the frozen shards live on the host between uses, and each gather first
copies the rank's shard to the device. ZeRO-Offload (Ren et al. 2021, arXiv:2101.06840) and
FSDP2's `CPUOffloadPolicy` place things the same way, gradients included ([Note: gradients go
with the optimizer]).

The step (`step_on_host`), for the units with a reduced gradient, a run of units at a time
(the runs of [Note: fp32 gradients a few units at a time] in units.py): the run's reduced
gradients are copied to host buffers on a stream of their own while the run before it steps,
widened to the master dtype and unscaled on the host, the user's optimizer steps the run's
master pieces with torch's fused CPU kernel where its class has one (Adam, AdamW, SGD,
Adagrad: `group["fused"]` is set for the host step only, where the user left it and
`foreach` unset; `foreach` otherwise), and each stepped unit's master is cast into a staging
buffer and copied to the device (under zero1 and zero2 into its owned slice, then all-gathered
while the next run steps; under zero3 into `kept`; under "params" cast into the host's `kept`
only). Under zero2 and zero3 the gradients are on the host already ([Note: gradients go with
the optimizer]); under zero1 they are copied down in the step. The host step itself runs after
backward, not unit by unit as gradients arrive: a unit stepped in backward would be stepped
before clipping, the fp16 overflow check, the step vote and continue mode's step boundary
decide over the whole step, and before a second backward adds to its gradients. Its own copies
overlap each other and the steps of the runs beside them. On a machine without CUDA the same
code runs with host buffers distinct from the "device" ones (both in CPU memory), every copy
made.

Host memory, beyond the masters and the optimizer state: under zero2 and zero3 the reduced
gradient shard (compute dtype), under zero1 two runs' compute-dtype gradients (the run
stepping, the next one landing); one run's gradients in the master dtype, two units' staging
buffers, and under "params" the compute-dtype shard. The step report gives the host
step's time as `host_step_s` (the optimizer's kernels and the host's casts) and the bytes
copied each way (observe/step_report.py).

Every copy to the device runs on the current stream, so the gathers and kernels issued after it
see it; every copy from the host starts from a buffer no host step changes before it is done:
the next step's first wait (for a run's gradients, whose copies follow everything issued on the
current stream before them) finishes every copy the previous step issued.

[Note: gradients go with the optimizer]
Under zero2 and zero3 (sharded gradients) the reduced gradient shard goes too, as it is made
in backward (`FlatUnit.offload_grad`, on the link's stream, overlapped with the rest of
backward), and its device memory is let go, as DeepSpeed's ZeRO-Offload lays it out: the
device holds about the units in flight, not a shard of every gradient until the step. What
reads the reduced gradients reads the host copies: the clip's norms (combined on the device),
fp16's overflow check (its flag moved to the device for the all-reduce), the host step (which
then downloads nothing). A second backward before zero_grad adds into the host copy. zero1
keeps full gradients on the device (its all-reduce needs them), so nothing goes down early.

Refused, by name: ddp (it keeps the whole optimizer state on every rank, so offloaded every
rank would step the whole model on its host; zero1 shards it first, with the same gradient
all-reduce and an all-gather of the update), "params" outside zero3 (only zero3 keeps shards
of the parameters between uses), DiLoCo (its inner optimizer is replicated, as ddp's).
staleness=1, PowerSGD and shard_size leave the gradients on the device as they do without
offload, and combine with it.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .units import step_runs

__all__ = ["OFFLOADS", "HostLink", "host_kernels", "step_on_host"]

OFFLOADS = ("optimizer", "params")
_FUSED_ON_CPU = tuple(getattr(torch.optim, name) for name in ("Adam", "AdamW", "SGD", "Adagrad")
                      if hasattr(torch.optim, name))


class HostLink:
    """Host buffers (pinned where CUDA exists) and the copies across the host link."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._buffers: dict[str, torch.Tensor] = {}
        self._events: dict[str, object] = {}  # the copy last reading or writing a buffer
        self._kept_down: list = []  # the gradient shards on their way to the host (keep_down)
        self.host_step_s = 0.0
        self.down_bytes = 0
        self.up_bytes = 0

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=self.cuda)

    def buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer kept from step to step (a fresh one each step costs a page fault per
        4 KiB), once the copy that last used it is done."""
        event = self._events.pop(name, None)
        if event is not None:
            event.synchronize()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(max(numel, 1), dtype=dtype,
                                                     pin_memory=self.cuda)
        return buf[:numel]

    def download(self, tensors: list[torch.Tensor], name: str) -> _Landing:
        """Copy `tensors` (on the device, one dtype) into host buffer `name`, on a stream of
        their own after what the current stream has issued; `wait()` before reading them."""
        dtype = tensors[0].dtype
        buf = self.buffer(name, sum(t.numel() for t in tensors), dtype)
        views, at = [], 0
        for t in tensors:
            views.append(buf[at:at + t.numel()])
            at += t.numel()
        self.down_bytes += at * buf.element_size()
        if not self.cuda:
            for view, t in zip(views, tensors):
                view.copy_(t)
            return _Landing(views, None)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for view, t in zip(views, tensors):
                view.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._events[name] = event
        return _Landing(views, event)

    def keep_down(self, source: torch.Tensor, target: torch.Tensor, add: bool = False) -> None:
        """Copy (or with `add`, add) the device tensor `source` into the host tensor `target`,
        on the link's stream after what the current stream has issued; `settle()` waits for
        every such copy. `source` may be let go at once (the allocator is told the stream
        uses it)."""
        self.down_bytes += source.numel() * source.element_size()
        if not self.cuda:
            target.add_(source) if add else target.copy_(source)
            return
        if add:  # a second backward before zero_grad: rare, so simply in order
            self.settle()
            target.add_(source.to("cpu"))
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        source.record_stream(self._stream)
        self._kept_down.append(event)

    def settle(self) -> None:
        """Wait for every `keep_down` copy issued so far."""
        events, self._kept_down = self._kept_down, []
        for event in events:
            event.synchronize()

    def upload(self, source: torch.Tensor, target: torch.Tensor, name: str) -> None:
        """Copy the host tensor `source` into `target` on the device, cast to its dtype on the
        host first (in staging buffer `name`), on the current stream."""
        if source.dtype != target.dtype:
            staging = self.buffer(name, source.numel(), target.dtype)
            staging.copy_(source)
            source = staging
        target.copy_(source, non_blocking=True)
        self.up_bytes += target.numel() * target.element_size()
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[name] = event

    def report(self) -> dict:
        """The step report's entries since the last (observe/step_report.py)."""
        out = {"host_step_s": self.host_step_s, "host_down_bytes": self.down_bytes,
               "host_up_bytes": self.up_bytes}
        self.host_step_s, self.down_bytes, self.up_bytes = 0.0, 0, 0
        return out


class _Landing:
    def __init__(self, views, event):
        self.views, self.event = views, event

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.views


@contextlib.contextmanager
def host_kernels(optimizer):
    """The user's optimizer with torch's fast CPU path for the host step (see the Note): its
    groups' `fused` (or `foreach`) set where the user left them unset, put back after."""
    groups = optimizer.param_groups
    saved = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in groups]
    fused = isinstance(optimizer, _FUSED_ON_CPU)
    for g in groups:
        if fused and "fused" in g and not g["fused"] and g.get("foreach") is None:
            g["fused"] = True
            if "foreach" in g:
                g["foreach"] = False
        elif "foreach" in g and g["foreach"] is None and not g.get("fused"):
            g["foreach"] = True
        if g.get("capturable"):  # CUDA graphs' option: the masters are host tensors
            g["capturable"] = False
    try:
        yield
    finally:
        for g, before in zip(groups, saved):
            g.update(before)


@torch.no_grad()
def step_on_host(engine, ready: list, unscale: float, step_one) -> None:
    """See [Note: offload]: step the units of `ready` on the host, a run at a time, and put
    the update on the device (all-gathered under zero1 and zero2)."""
    link, optimizer = engine.host_link, engine.optim.optimizer
    sizes = [u.reduced.numel() * torch.finfo(u.master_dtype).bits // 8 for u in ready]
    runs = [[ready[i] for i in run] for run in step_runs(sizes, engine.step_chunk_bytes)]
    link.settle()  # the gradient shards sent down in backward (FlatUnit.offload_grad)

    def land(run, name):
        if all(u.reduced is u.host_grad for u in run):  # there already
            return _Landing([u.reduced for u in run], None)
        return link.download([u.reduced for u in run], name)
    landing = land(runs[0], "grads0")
    works, raised = [], None
    for i, run in enumerate(runs):
        grads = landing.wait()
        if i + 1 < len(runs):  # the next run's gradients land while this one steps
            landing = land(runs[i + 1], f"grads{(i + 1) % 2}")
        began = time.perf_counter()
        widen = [j for j, (u, g) in enumerate(zip(run, grads))
                 if g.dtype != u.master_dtype or unscale != 1.0]
        for dtype in {run[j].master_dtype for j in widen}:  # one buffer per master dtype
            mine = [j for j in widen if run[j].master_dtype == dtype]
            wide, at = link.buffer(f"wide {dtype}", sum(grads[j].numel() for j in mine), dtype), 0
            for j in mine:
                grads[j] = wide[at:at + grads[j].numel()].copy_(grads[j]).mul_(unscale)
                at += grads[j].numel()
        for unit, g in zip(run, grads):
            unit.set_piece_grads(g)
        if raised is None:
            try:
                with host_kernels(optimizer):
                    step_one()
            except BaseException as exc:  # noqa: BLE001 - raised once the others are let go
                raised = exc
        for unit in run:
            unit.set_piece_grads(None)
        link.host_step_s += time.perf_counter() - began
        for j, unit in enumerate(run):
            unit.publish(link, f"up{j % 2}")
            if not engine.reshards:  # on the wire while the next run steps
                works.append(unit.unshard(engine.comm, written=True))
    for work in works:
        if work is not None:
            work.wait()
    if raised is not None:  # see [Note: a step that raised in the optimizer] in vote.py
        raise raised
