"""`px.prepare` and the verbs that act on a prepared model.

    model, optimizer = px.prepare(model, optimizer, strategy="ddp", precision="fp32")

The order of what prepare does matters, and is the same on every rank:
  1. validate: every option alone and together, resolved into a `Spec` (model/spec.py)
     before any collective, so a typo fails on every rank alike without anyone waiting;
  2. build: give the model its values (a meta build drawn, pretrained weights read), move it
     to this rank's device and, if asked, convert BatchNorm to its synchronized form
     (parameters keep their identity, so the optimizer still holds them);
  3. check: compare the model's structure and the options across ranks
     (model/consistency.py), then broadcast rank 0's parameters and buffers;
  4. wrap: build the engine (engine/: one flat engine, the strategy a row of its policy
     table) and the module whose forward keeps buffers in sync and applies the precision.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..comm import continuation
from ..comm.collectives import Comm
from ..comm.records import StepCounter
from ..engine import build_engine, optimizer_state_dict as _optimizer_state_dict
from ..engine.hybrid import shard_groups, shard_size_in
from ..engine.optim import optimizer_groups
from ..engine.units import resolve_block_classes
from ..engine.zero3_roots import engine_roots
from ..faults.nonfinite import NonFiniteWatch
from ..faults.replica_check import ReplicaCheck
from ..observe.metrics import note_run
from ..observe.step_report import StepClock, step_stats as _step_stats
from ..spec.arguments import check_prepare
from ..spec.precisions import PRECISIONS
from ..world import runtime
from .buffers import BufferBroadcast
from .consistency import broadcast_from_rank0, check_same_structure
from .diloco import attach as attach_diloco, inner_comm
from .materialize import fill_shards, materialize, on_meta as on_meta_device
from .nf4_base import convert as convert_to_nf4
from .precision import cast_model, make_precision
from .prepared import PreparedModule
from .pretrained import PretrainedWeights
from .spec import Spec
from .sync_batchnorm import convert_sync_batchnorm

__all__ = ["prepare", "unwrap", "no_sync", "clip_grad_norm_", "optimizer_state_dict",
           "PRECISIONS"]

def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,  # noqa: PLR0913
            strategy: str = "ddp", precision: str = "fp32", *, bucket_mb: float = 25.0,
            comm_dtype: torch.dtype | None = None, sync_batchnorm: bool = False,
            broadcast_buffers: bool = True, comm: Comm | None = None,
            check_replicas_every: int | None = None, on_nonfinite: str | None = "raise",
            step_stats: bool = True, init=None, prefetch: int | None = None,
            max_gathered_mb: float | None = None, reshard_after_forward: bool = True,
            blocks=None, output_dtype: torch.dtype | None = torch.float32, staleness: int = 0,
            shard_size: int | str | None = None, compression=None, offload: str | None = None,
            step_in_backward: bool = False, base_dtype: str | None = None):
    """Wrap `model` (and `optimizer`) for data-parallel training; returns `(model, optimizer)`.

    strategy: "ddp" (replicated), "zero1" (optimizer state sharded), "zero2" (and gradients),
        "zero3" (alias "fsdp": and parameters, each unit gathered while it computes), or
        px.DiLoCo(sync_every=H): local steps on each rank and an averaged outer step every H.
    precision: "fp32" (the parameters' own dtype), or "bf16"/"fp16" compute with master
        weights in the parameters' dtype (fp16 with dynamic loss scaling), or "bf16-true":
        weights, gradients and optimizer state in bf16 with no master, each step in fp32
        rounded back stochastically, so small updates are kept on average.
    bucket_mb: cap of a unit (gradient bucket), in MiB; the first is at most 1 MiB.
    blocks: the repeated blocks, each a unit (split under bucket_mb) and, under zero3, gathered
        as one: a module class, its name, or a tuple of them (default: the children of the
        model's largest nn.ModuleList).
    comm_dtype: torch.bfloat16 / torch.float16 to compress gradient communication.
    compression: px.PowerSGD(rank=..., start_step=...) sends low-rank factors of the gradients
        (ddp, zero1, zero2), with error feedback; None sends them whole.
    output_dtype: under bf16/fp16, the dtype floating outputs are cast to (default
        torch.float32); None leaves them in the compute dtype.
    sync_batchnorm: BatchNorm statistics over all ranks (CPU and GPU).
    broadcast_buffers: keep buffers equal to rank 0's, as torch DDP does: broadcast at the end
        of each backward that synchronises, so every rank trains and evaluates with rank 0's
        statistics, and an evaluation makes no collective.
    comm: the `phalanx.comm.collectives.Comm` to communicate through (default: one over the job's
        process group); `Comm(group, prefer="reduce_scatter")` picks primitives by hand.
    check_replicas_every: every K optimizer steps, compare a checksum of the parameters
        across ranks and raise `px.ReplicasDiffer` on every rank, naming the ranks that
        drifted; None: never.
    on_nonfinite: a NaN or inf loss on any rank, seen at the end of backward on every rank:
        "raise" `px.NonFiniteError` naming the ranks and the step (its
        gradients dropped), "skip" the step with a warning, "warn" only, or None (no check).
    staleness: 1 applies step t-1's averaged gradients at step t, so their averaging has a
        whole step to finish (ddp, zero1, zero2); 0 (default): step t's.
    shard_size: zero1/zero2/zero3 shard within groups of this many consecutive ranks and
        replicate across the groups ("node": the launcher's LOCAL_WORLD_SIZE); gradients are
        averaged across groups, nothing else crosses them. None: all ranks.
    offload: "optimizer" keeps the masters and the optimizer state in host memory (pinned
        where CUDA exists) and steps them there, unit by unit, copying the updated parameters
        back (zero1, zero2, zero3); "params" (zero3) keeps its parameter shards there between
        uses too; None (default): everything on the device. The step report's `host_step_s`
        is the host step's share.
    step_in_backward: step each unit's parameters as soon as its gradient is reduced, in the
        backward that synchronises (the last micro-batch's under px.no_sync), and free that
        gradient, so zero2/zero3 hold about one unit's reduced gradient instead of a shard of
        all of them; `optimizer.step()` then only closes the step. A global clip
        (px.clip_grad_norm_) cannot run then and is refused, as are fp16, staleness,
        compression, DiLoCo and offload with it.
    base_dtype: "nf4" (zero3) stores every frozen nn.Linear weight in NF4, 4 bits an element
        and scales in blocks, each rank keeping 1/N of it, gathered and dequantized while its
        layer computes (QLoRA's base); needs torchao. None: as the model holds them.
    step_stats: time every optimizer step for `px.step_stats(model)`.
    init: fn(model) setting every parameter and buffer of a meta build (default: each module's
        reset_parameters(), in order; a PEFT model's adapters after its base, as
        get_peft_model draws them), or px.from_safetensors(path) for any model, a PEFT
        model of the files' model included; a path (str or os.PathLike) means the latter.
    zero3 only:
    prefetch: how many roots ahead to gather while one computes (a root: a repeated block, or
        the module whose forward brackets a unit's uses), in the last forward's order and the
        last backward's; 0: gather each when it is needed; None: 1.
    max_gathered_mb: a bound on the full parameters gathered at once, in MiB; prefetching stops
        short of it (a unit needed now is gathered whatever its size). None: no bound.
    reshard_after_forward: False keeps each unit's parameters from its forward to its backward
        (one all-gather per unit and step instead of two, for the memory of every unit).

    After prepare the ordinary loop works and gradients are the mean over ranks.
    """
    check_prepare(model, optimizer)  # the model and optimizer where they go (arguments.py)
    spec = Spec.of(
        strategy, precision, optimizer=optimizer, bucket_mb=bucket_mb, comm_dtype=comm_dtype,
        sync_batchnorm=sync_batchnorm, broadcast_buffers=broadcast_buffers,
        check_replicas_every=check_replicas_every, on_nonfinite=on_nonfinite,
        step_stats=step_stats, prefetch=prefetch, max_gathered_mb=max_gathered_mb,
        reshard_after_forward=reshard_after_forward, output_dtype=output_dtype,
        staleness=staleness, shard_size=shard_size, compression=compression, offload=offload,
        step_in_backward=step_in_backward, base_dtype=base_dtype)
    if prepared_or_none(model) is not None:
        raise ValueError("this model was already prepared; call px.prepare once per model")
    block_classes = resolve_block_classes(model, blocks)
    runtime.init()
    steps = StepCounter()  # this model's optimizer steps: see [Note: steps per model]
    if comm is None:
        comm = runtime.job_comm(steps=steps)
    elif comm.steps is None:
        comm.steps = steps
    _refuse_compiled_zero3(model, spec, comm)
    shard_size = spec.shard_size_for(comm.world)
    model, built = _build(model, optimizer, spec, comm, init)
    check_same_structure(model, comm, spec.compared(shard_size, block_classes))
    if not built.on_meta and built.reading is None:
        broadcast_from_rank0(model, comm)
    return _wrap(model, optimizer, spec, comm, built,
                 Build(spec, block_classes, shard_size, steps))


@dataclass
class _Built:
    """How `_build` found and left the model, for what follows it."""
    on_meta: bool         # built on the meta device: every rank drew (or read) the same values
    reading: object       # px.from_safetensors' plan of reads (pretrained.py), or None
    shards_only: bool     # zero3 keeps each rank's shards only: drawn after the engine is built
    dtypes: dict | None   # what a full build draws into, before the cast (for fill_shards)


def _refuse_compiled_zero3(model, spec: Spec, comm) -> None:
    if spec.policy.reshards(comm.world) and uncompiled(model) is not model:
        # tried: nanoGPT's order under zero3 fails inside dynamo's guards (IndexError in
        # produce_guards), tracing the hooks that gather and free each block
        raise ValueError(
            "zero3 takes the model uncompiled: its parameters are gathered and freed by hooks "
            "around each block's forward, and a model compiled first fails while dynamo "
            "traces them (torch 2.13). Pass the model "
            "before torch.compile (px.prepare(model, ...)), or use strategy='zero2', which "
            "takes a compiled model")


def _build(model, optimizer, spec: Spec, comm, init):
    """Give the model its values and its place: drawn on a meta build (or read from
    pretrained weights) on every rank alike, moved to this rank's device, BatchNorm made
    synchronized if asked, the optimizer's groups taken. Returns the model and a `_Built`."""
    on_meta = on_meta_device(model)
    # init=px.from_safetensors(path), or the path: checked against the model on every rank
    # (pretrained.py)
    weights = PretrainedWeights.of(init)
    init = init if weights is None else weights
    reading = weights.plan(uncompiled(model), comm) if weights is not None else None
    # zero3 draws (or reads) the values after the engine is built, keeping each rank's shards
    shards_only = on_meta and spec.policy.reshards(comm.world) and (
        init is None or reading is not None)
    if on_meta:  # every rank draws (or reads) the same values: no broadcast after
        materialize(uncompiled(model), optimizer, runtime.device(), comm, init,
                    values=not shards_only, reading=reading)
    elif reading is not None:  # every rank reads the whole model: no broadcast either
        reading.load()
    model.to(runtime.device())
    if reading is not None:  # what no file has and was not drawn: rank 0's (a PEFT adapter)
        reading.share_kept(comm)
    if spec.sync_batchnorm:
        # under continue mode the job's group, whatever it is at each forward (continuing/)
        group = None if continuation.continuing() else comm.group
        model = convert_sync_batchnorm(model, group=group)
    if optimizer is not None:
        optimizer_groups(optimizer, model)
    dtypes = {id(p): p.dtype for p in model.parameters()} if shards_only else None
    return model, _Built(on_meta, reading, shards_only, dtypes)


def _wrap(model, optimizer, spec: Spec, comm, built: _Built, build: Build):
    """Cast the model to the precision, build its engine (and DiLoCo's outer step), hang the
    step report on it, and wrap it in the module px.prepare returns."""
    precision = make_precision(spec.precision, spec.comm_dtype, spec.output_dtype,
                               ranks=comm.world)
    steps = build.steps
    if spec.base_dtype is not None:  # [Note: an NF4 base in shards] in nf4_base.py
        if built.shards_only and built.reading is None:
            raise ValueError(
                f"base_dtype={spec.base_dtype!r} quantizes each frozen weight from its values, "
                "and this zero3 model on the meta device draws them only as each rank's "
                "shards; give it its weights: init=px.from_safetensors(path) (each weight read "
                "whole and quantized as it is read), or build it with them before px.prepare")
        convert_to_nf4(uncompiled(model), comm.apart("nf4:gathers"),
                       read=built.reading.take_whole if built.shards_only else None,
                       block_classes=build.block_classes)
    original_dtypes = {k: v.dtype for k, v in uncompiled(model).state_dict(keep_vars=True).items()
                       if isinstance(v, torch.Tensor)}
    cast_model(model, precision)
    engine = attach_engine(model, optimizer, comm, build, precision)
    _warn_oversized(engine, spec.gathering)
    if built.shards_only:  # see [Note: only the shards are kept] in model/materialize.py
        fill_shards(model, engine.held_pieces(), comm, built.dtypes, built.reading)
        engine.publish_masters()  # offload: what the gathers start from (engine/offload.py)
    outer = attach_diloco(spec.diloco, model, engine, optimizer, comm)  # None unless DiLoCo
    note_run({"strategy": spec.strategy, "precision": spec.precision.name, "world": comm.world,
              "backend": comm.backend, "device": str(runtime.device()),
              "bucket_mb": spec.bucket_mb, "comm_dtype": spec.comm_dtype,
              "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "optimizer": _optimizer_name(optimizer), "zero3": engine_roots(engine)})
    clock = StepClock(comm, runtime.device(), steps,
                      engine.groups() if outer is None else outer.groups(),
                      across=engine.names_across()) if spec.step_stats else None
    if clock is not None and optimizer is not None:
        engine.watch_steps(optimizer, clock.step_done)
    if clock is not None:  # --on-failure continue: each change of members (continuing/)
        continuation.now().watch_clock(clock, engine)
    if clock is not None and engine.compression is not None:
        clock.extras.append(engine.compression.step_report)
    if clock is not None and engine.host_link is not None:
        clock.extras.append(engine.host_link.report)  # offload: the host step's share
    wrapped = PreparedModule(model, engine, comm, precision,
                             original_dtypes=original_dtypes, clock=clock,
                             device=runtime.device(), outer=outer, build=build,
                             optimizer=optimizer)
    continuation.now().watch_model(wrapped)  # phalanx run --on-failure continue only
    return wrapped, optimizer


@dataclass(frozen=True)
class Build:
    """What a prepared model's engine is built from besides the model: the spec, and what
    px.prepare resolved beside it (the repeated blocks' classes, the shard group's size for
    the world it saw, the model's step counter). Kept so that the engine can be built again
    for another layout (model/relayout.py: a generation of other members under `phalanx run
    --on-failure continue`)."""
    spec: Spec
    block_classes: tuple | None
    shard_size: int | None
    steps: StepCounter


def attach_engine(model, optimizer, comm, build: Build, precision):
    """Build `model`'s engine over `comm` and hang on it what watches its steps: the
    non-finite check, the step counter, continue mode's step boundary, the replica check."""
    spec = build.spec
    # the whole world, or a group of it; a world of one under DiLoCo (model/diloco.py)
    # a world that `shard_size` does not divide, under continue mode: see [Note: shard
    # groups after a loss] in engine/hybrid.py
    shard_comm, replicas = shard_groups(inner_comm(comm) if spec.diloco is not None else comm,
                                        shard_size_in(build.shard_size, comm.world))
    broadcast = spec.broadcast_buffers and spec.diloco is None
    watch = NonFiniteWatch(spec.on_nonfinite, shard_comm) \
        if spec.on_nonfinite is not None else None  # DiLoCo: its own
    engine = build_engine(model, optimizer, shard_comm, spec, precision,
                          block_classes=build.block_classes, replicas=replicas,
                          buffers=BufferBroadcast.of(model, comm) if broadcast else None,
                          nonfinite=watch, steps=build.steps)
    if optimizer is not None:  # the step that collective records and reports name
        engine.watch_steps(optimizer, build.steps.tick)
    if continuation.continuing() and optimizer is not None:  # the vote: continuing/steps.py
        continuing = continuation.now()
        engine.guard_steps(optimizer, lambda: continuing.before_step(engine.comm))
    if spec.check_replicas_every is not None and optimizer is not None:
        names = [name for name, _ in model.named_parameters()]
        engine.watch_steps(optimizer, ReplicaCheck(model.parameters(), names, comm,
                                                   spec.check_replicas_every).after_step)
    return engine


def _warn_oversized(engine, gathering) -> None:
    gatherer = engine.gatherer
    if gatherer is None or gathering is None or gathering.max_gathered_mb is None:
        return
    max_gathered_mb = gathering.max_gathered_mb
    big = gatherer.oversized()
    if big and runtime.rank() == 0:
        names = ", ".join(f"{name!r} ({size / 2**10:.1f} KiB)" for name, size in big[:5])
        warnings.warn(f"zero3: max_gathered_mb={max_gathered_mb} is below what these units need "
                      f"on their own: {names}; each is gathered whole when it computes, with "
                      "nothing prefetched beside it (raise the bound, or lower bucket_mb to "
                      "split what is not a repeated block)", stacklevel=3)


def _optimizer_name(optimizer) -> str | None:
    """The planner's name for the optimizer's state (memory.py's OPTIMIZERS), where known."""
    if optimizer is None:
        return None
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return "sgd-momentum" if momentum else "sgd"
    return name if name in ("adamw", "adam", "adafactor") else None


def uncompiled(model):
    """See through `torch.compile(module)`: the module it compiled, else `model` itself.

    Only a compiled module itself is seen through: it holds the module it compiled as its child
    `_orig_mod`. Asking any module for an attribute `_orig_mod` would not do, since a prepared
    model forwards unknown attributes to the module it wraps, and a prepared model of a model
    compiled first (`px.prepare(torch.compile(model))`, as nanoGPT's train.py orders it) would
    answer with that model."""
    inner = getattr(model, "_modules", {}).get("_orig_mod")
    return inner if inner is not None and type(model).__name__ == "OptimizedModule" else model


def prepared_or_none(model) -> PreparedModule | None:
    """The `PreparedModule` of a prepared model, or of `torch.compile` of one; else None."""
    inner = uncompiled(model)
    return inner if isinstance(inner, PreparedModule) else None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's original module inside a prepared model (the model itself otherwise): the
    module given to px.prepare, compiled if it was compiled before (as DDP's `.module` is)."""
    inner = prepared_or_none(model)
    return inner.module if inner is not None else model


def _prepared(model) -> PreparedModule:
    inner = prepared_or_none(model)
    if inner is None:
        raise TypeError("expected the model returned by px.prepare (or torch.compile of it), "
                        f"not {type(model).__name__}")
    return inner


def step_stats(model: torch.nn.Module, all_ranks: bool = False) -> dict:
    """The last optimizer step's report on this rank: wall, forward, backward, optimizer and
    other (data loading) seconds, communication in flight and exposed, overlap, bytes and
    bandwidth per collective kind, throughput, memory. Empty before the first step.
    `all_ranks=True` is a collective (every rank calls it) that adds the slowest rank,
    the skew between ranks, and each rank's busy time and memory."""
    return _step_stats(_prepared(model)._clock, all_ranks)


def no_sync(model: torch.nn.Module):
    """Context for accumulation micro-steps: backward inside it communicates nothing; the next
    backward outside it averages everything accumulated."""
    return _prepared(model).no_sync()


def clip_grad_norm_(model: torch.nn.Module, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm over all ranks and shards; returns that norm."""
    return _prepared(model)._engine.clip_grad_norm_(max_norm, norm_type)


def optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state in a single process's format (keyed by each parameter's position
    in the param groups as built, tensors of the parameter's shape), on every rank.

    A collective under zero1, zero2 and zero3 (every rank must call it): the shards of the
    state are gathered at once. `optimizer.state_dict()` gives the same on one rank alone,
    reading the other ranks' shares while they go on (as nanoGPT saves, inside
    `if master_process:`); under ddp both are this rank's own state.
    `optimizer.load_state_dict()` takes this format under every strategy, precision and world
    size, each rank keeping its slices, and so does `px.prepare` for state already in the
    optimizer when it is prepared."""
    # The mechanism: [Note: the optimizer's state_dict] in engine/optim.py.
    return _optimizer_state_dict(optimizer)
