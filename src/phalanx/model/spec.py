"""What `px.prepare` and `px.plan` are asked, resolved once into meanings: the `Spec`.

    spec = Spec.of(strategy="fsdp", precision="bf16-mixed", offload="optimizer")
    spec.policy          # ShardPolicy("zero3", params=SHARD, ..., masters=HOST): engine/policy.py
    spec.precision       # PrecisionSpec("bf16", torch.bfloat16, ...): spec/precisions.py
    spec.gathering       # zero3's gathers (Gathering), None for a strategy that gathers nothing

Names travel no further than `Spec.of`: the strategy's name becomes its residency row (with the
places `offload` gives it), the precision's its PrecisionSpec, `staleness=1` a `Staleness`,
`offload` an `Offload`, a DiLoCo strategy its `px.DiLoCo` beside the ddp row its inner steps
run on; the compressor is the `px.PowerSGD` given. Everything after asks the meaning
(`spec.policy.params is SHARD`, `spec.precision.loss_scaling`), never the name.

`Spec.of` checks each option alone, then the table of combinations that do not go together
(`COMBINATIONS`, below: one row each, in the order they are tried), then continue mode's
refusals (`CONTINUE_MODE`): the same arguments fail alike on every rank before any collective,
so no rank is left waiting for another. What depends on the world too (`shard_size`) is checked
once the world is known (`shard_size_for`). The planner builds the same object for each
strategy it plans (planner/setting.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..comm.gate import continuing
from ..engine.hybrid import check_shard_size
from ..engine.offload import OFFLOADS
from ..engine.policy import FULL, POLICIES, SHARD, ShardPolicy, placed
from ..engine.powersgd_config import PowerSGD
from ..faults.nonfinite import MODES as NONFINITE_MODES
from ..spec.precisions import PrecisionSpec, precision_spec
from ..spec.strategies import strategy_name
from .diloco import DiLoCo, check_diloco_optimizer, split_strategy
from .precision import COMM_DTYPES

__all__ = ["Spec", "Gathering", "Staleness", "Offload", "Rule", "COMBINATIONS", "CONTINUE_MODE",
           "gathering_of", "refuse", "first_refusal"]


@dataclass(frozen=True)
class Gathering:
    """zero3's gathers (engine/zero3.py): how many roots ahead, a bound on what is gathered at
    once (MiB, None: none), and whether a unit is freed between its forward and backward."""

    prefetch: int | None = 1
    max_gathered_mb: float | None = None
    reshard_after_forward: bool = True

    @property
    def asked(self) -> bool:
        """Whether any of them was given (`prefetch` None: not given)."""
        return (self.prefetch is not None or self.max_gathered_mb is not None
                or not self.reshard_after_forward)

    def options(self) -> dict:
        """The gatherer's keyword arguments."""
        limit = None if self.max_gathered_mb is None else int(self.max_gathered_mb * 2**20)
        return {"prefetch": 1 if self.prefetch is None else self.prefetch,
                "max_gathered_bytes": limit, "reshard_after_forward": self.reshard_after_forward}


@dataclass(frozen=True)
class Staleness:
    """`staleness=1`: step t applies step t-1's averaged gradients (engine/delayed.py)."""

    steps: int = 1


@dataclass(frozen=True)
class Offload:
    """`offload=`: "optimizer" (masters and optimizer state in host memory, stepped there) or
    "params" (zero3's parameter shards there between uses too): engine/offload.py."""

    what: str

    @property
    def params(self) -> bool:
        return self.what == "params"


@dataclass(frozen=True)
class Spec:
    """px.prepare's options resolved (see the module docstring). Built by `Spec.of`, and by the
    planner for each strategy it plans (planner/setting.py, which asks COMBINATIONS of it)."""

    policy: ShardPolicy            # the strategy's row, with offload's places (engine/policy.py)
    precision: PrecisionSpec       # compute dtype, masters, loss scaling (spec/precisions.py)
    comm_dtype: torch.dtype | None  # the gradients' dtype on the wire (None: the compute dtype)
    output_dtype: torch.dtype | None  # floating outputs under low precision (None: kept)
    bucket_mb: float
    gathering: Gathering | None    # zero3's; None for a strategy that gathers nothing
    shard_size: object             # as given: resolved against the world by shard_size_for
    staleness: Staleness | None
    compression: PowerSGD | None
    offload: Offload | None
    diloco: DiLoCo | None          # the strategy, when it is DiLoCo (policy: its inner ddp)
    sync_batchnorm: bool = False
    broadcast_buffers: bool = True
    check_replicas_every: int | None = None
    on_nonfinite: str | None = "raise"
    step_stats: bool = True
    step_in_backward: bool = False  # each unit stepped as its gradient is reduced (stepping.py)
    base_dtype: str | None = None   # "nf4": frozen Linear weights in NF4 shards (nf4_base.py)

    # -- what the rest of phalanx asks ------------------------------------------------------------
    @property
    def strategy(self) -> str:
        """The strategy's name, for messages and records ("ddp" under DiLoCo: its inner steps)."""
        return self.policy.name

    @property
    def reshards(self) -> bool:
        """The parameters are sharded between uses and gathered while a unit computes (zero3)."""
        return self.policy.params is SHARD

    def shard_size_for(self, world: int) -> int | None:
        """The shard group's size in a world of `world` ranks (None: all of them)."""
        return check_shard_size(self.shard_size, self.policy, world, self.staleness_steps)

    @property
    def staleness_steps(self) -> int:
        return 0 if self.staleness is None else self.staleness.steps

    def compared(self, shard_size, block_classes) -> dict:
        """What every rank must have alike (model/consistency.py compares it), and what
        `px.prepare` was asked, in its own words."""
        gathering = self.gathering or Gathering()
        return {"strategy": self.strategy, "precision": self.precision.name,
                "bucket_mb": self.bucket_mb, "comm_dtype": self.comm_dtype,
                "sync_batchnorm": self.sync_batchnorm,
                "broadcast_buffers": self.broadcast_buffers, "output_dtype": self.output_dtype,
                "check_replicas_every": self.check_replicas_every,
                "on_nonfinite": self.on_nonfinite, **gathering.options(),
                "staleness": self.staleness_steps, "shard_size": shard_size,
                "compression": self.compression,
                "offload": None if self.offload is None else self.offload.what,
                "blocks": None if block_classes is None else [c.__name__ for c in block_classes],
                "diloco": self.diloco, "step_in_backward": self.step_in_backward,
                "base_dtype": self.base_dtype}

    # -- made once, from px.prepare's keywords ----------------------------------------------------
    @classmethod
    def of(cls, strategy="ddp", precision="fp32", *, optimizer=None, bucket_mb=25.0,  # noqa: PLR0913
           comm_dtype=None, sync_batchnorm=False, broadcast_buffers=True,
           check_replicas_every=None, on_nonfinite="raise", step_stats=True, prefetch=None,
           max_gathered_mb=None, reshard_after_forward=True, output_dtype=torch.float32,
           staleness=0, shard_size=None, compression=None, offload=None,
           step_in_backward=False, base_dtype=None) -> Spec:
        """px.prepare's keywords, each checked alone, then together (COMBINATIONS) and against
        continue mode (CONTINUE_MODE): a ValueError (or TypeError) that names the option and a
        value that works, raised on every rank alike."""
        diloco, strategy = split_strategy(strategy)
        policy = POLICIES[strategy_name(strategy)]
        spec = cls(
            policy=policy, precision=precision_spec(precision),
            comm_dtype=_comm_dtype(comm_dtype), output_dtype=_output_dtype(output_dtype),
            bucket_mb=_bucket_mb(bucket_mb),
            gathering=gathering_of(prefetch, max_gathered_mb, reshard_after_forward),
            shard_size=shard_size, staleness=_staleness(staleness),
            compression=_compression(compression), offload=_offload(offload), diloco=diloco,
            sync_batchnorm=bool(sync_batchnorm), broadcast_buffers=bool(broadcast_buffers),
            check_replicas_every=_replicas_every(check_replicas_every),
            on_nonfinite=_on_nonfinite(on_nonfinite), step_stats=bool(step_stats),
            step_in_backward=_step_in_backward(step_in_backward),
            base_dtype=_base_dtype(base_dtype))
        check_diloco_optimizer(diloco, optimizer)
        refuse(spec, COMBINATIONS)
        if continuing():  # phalanx run --on-failure continue
            refuse(spec, CONTINUE_MODE)
        # the rows' places, and the gathers only where there is something to gather
        policy = placed(policy, None if spec.offload is None else spec.offload.what)
        gathering = spec.gathering
        gathering = replace(gathering, prefetch=1 if gathering.prefetch is None
                            else gathering.prefetch) if spec.reshards else None
        return replace(spec, policy=policy, gathering=gathering)


@dataclass(frozen=True)
class Rule:
    """A combination that does not go together: when `applies(spec)`, `says(spec)` is the
    message (the cause, and a fix)."""

    applies: Callable[[Spec], bool]
    says: Callable[[Spec], str]


def first_refusal(spec: Spec, rules: tuple[Rule, ...]) -> str | None:
    """The message of the first rule of `rules` that applies to `spec` (None: none does)."""
    return next((rule.says(spec) for rule in rules if rule.applies(spec)), None)


def refuse(spec: Spec, rules: tuple[Rule, ...]) -> None:
    """Raise the first rule of `rules` that applies to `spec`, as a ValueError."""
    refusal = first_refusal(spec, rules)
    if refusal is not None:
        raise ValueError(refusal)


_CONTINUE = "phalanx run --on-failure continue: "
_RESTART = "; run it under --on-failure restart (every worker restarts from the last checkpoint)"

# The combinations px.prepare refuses, in the order they are tried. A row asks meanings only.
COMBINATIONS: tuple[Rule, ...] = (
    Rule(lambda s: s.check_replicas_every is not None and s.reshards,
         lambda s: "check_replicas_every compares whole parameters, which zero3 never keeps "
                   "between steps; use it with ddp, zero1 or zero2"),
    Rule(lambda s: s.diloco is not None and s.comm_dtype is not None,
         lambda s: "comm_dtype= compresses gradients, which DiLoCo never sends; give the "
                   "pseudo-gradient's dtype to DiLoCo: px.DiLoCo(sync_every=H, "
                   "comm_dtype=torch.bfloat16)"),
    Rule(lambda s: s.diloco is not None and s.sync_batchnorm,
         lambda s: "sync_batchnorm=True communicates in every forward, and DiLoCo's inner "
                   "steps communicate nothing (BatchNorm statistics are averaged at each "
                   "sync); leave sync_batchnorm False"),
    Rule(lambda s: s.diloco is not None and s.check_replicas_every is not None,
         lambda s: "check_replicas_every compares replicas that DiLoCo lets differ between "
                   "syncs; leave it None"),
    Rule(lambda s: not s.reshards and s.gathering.asked,
         lambda s: f"prefetch, max_gathered_mb and reshard_after_forward are zero3's: "
                   f"strategy {s.strategy!r} keeps whole parameters and gathers nothing"),
    Rule(lambda s: s.staleness is not None and s.reshards,
         lambda s: "staleness=1 is not available with zero3: zero3 reduces each unit's "
                   "gradient into its shard as backward frees the unit, and a delayed average "
                   "would keep a full gradient buffer per unit in flight, the memory zero3 "
                   "exists to save; use strategy='zero2' (sharded gradients and optimizer "
                   "state) with staleness=1"),
    Rule(lambda s: s.staleness is not None and s.precision.loss_scaling,
         lambda s: "staleness=1 is not available with precision='fp16': a gradient scaled by "
                   "one step's loss scale would be unscaled by the next step's; use "
                   "precision='bf16' (no loss scaling) or 'fp32'"),
    Rule(lambda s: s.compression is not None and s.reshards,
         lambda s: "compression=PowerSGD(...) needs the whole gradient matrix of each "
                   "parameter on every rank to factor it, and zero3 reduces each unit's "
                   "gradients straight to the owned shards of parameters it gathers and frees, "
                   "so no rank holds it. Use strategy='zero2' (the optimizer state and "
                   "gradients sharded, the parameters whole) with PowerSGD, or zero3 without "
                   "compression"),
    Rule(lambda s: s.compression is not None and s.comm_dtype is not None,
         lambda s: f"compression=PowerSGD(...) with comm_dtype={s.comm_dtype!r}: the two are "
                   "not combined (the factors are orthogonalized after the first all-reduce "
                   "and carry the error feedback; they travel in the gradients' own dtype). "
                   "Pass one of them: PowerSGD sends far fewer bytes than a 16-bit comm_dtype "
                   "on its own"),
    Rule(lambda s: s.compression is not None and s.precision.loss_scaling,
         lambda s: "compression=PowerSGD(...) with precision='fp16': the error feedback "
                   "carries gradients from one step to the next, and under fp16 they are "
                   "multiplied by a loss scale that changes between steps. Use "
                   "precision='bf16' (no loss scaling) or 'fp32' with PowerSGD"),
    Rule(lambda s: s.staleness is not None and s.diloco is not None,
         lambda s: "staleness=1 delays each step's gradient average, and DiLoCo averages no "
                   "gradients between its syncs: use one of them, not both"),
    Rule(lambda s: s.diloco is not None and s.shard_size is not None,
         lambda s: "shard_size shards zero1/zero2/zero3 state within groups; DiLoCo's inner "
                   "steps are replicated and local: leave shard_size out"),
    Rule(lambda s: s.compression is not None and s.diloco is not None,
         lambda s: "compression=PowerSGD compresses each step's gradient average, and DiLoCo "
                   "averages no gradients between its syncs: use one of them"),
    Rule(lambda s: s.compression is not None and s.staleness is not None,
         lambda s: "compression=PowerSGD with staleness=1 is not supported: the delayed "
                   "average sends the bucket whole; use one of them"),
    Rule(lambda s: s.compression is not None and s.shard_size is not None,
         lambda s: "compression=PowerSGD with shard_size is not supported: the average across "
                   "shard groups is sent whole; leave shard_size out or compression"),
    Rule(lambda s: s.offload is not None and s.diloco is not None,
         lambda s: "offload with strategy=DiLoCo is not supported: its inner optimizer is "
                   "replicated on every rank, as ddp's; use offload with zero1, zero2 or zero3"),
    Rule(lambda s: s.offload is not None and s.policy.optimizer is FULL,
         lambda s: f"offload={s.offload.what!r} with strategy='ddp': ddp keeps the whole "
                   "optimizer state on every rank, so every rank would step the whole model on "
                   "its host; use strategy='zero1' (the same gradient all-reduce, the state "
                   "sharded), 'zero2' or 'zero3'"),
    Rule(lambda s: s.offload is not None and s.offload.params and not s.reshards,
         lambda s: f"offload='params' with strategy={s.strategy!r}: only zero3 keeps shards of "
                   "the parameters between uses; use offload='optimizer', or strategy='zero3'"),
)

_IN_BACKWARD = "step_in_backward=True steps each unit as soon as its gradient is reduced, "
COMBINATIONS += (
    Rule(lambda s: s.step_in_backward and s.precision.loss_scaling,
         lambda s: _IN_BACKWARD + "and precision='fp16' decides whether a step runs from an "
                   "overflow check over every gradient, which only the end of backward has; "
                   "use precision='bf16' (no loss scaling) or 'fp32'"),
    Rule(lambda s: s.step_in_backward and s.staleness is not None,
         lambda s: _IN_BACKWARD + "and staleness=1 applies each step's gradient a step later: "
                   "use one of them"),
    Rule(lambda s: s.step_in_backward and s.compression is not None,
         lambda s: _IN_BACKWARD + "and compression=PowerSGD is not supported with it: leave "
                   "one of them out"),
    Rule(lambda s: s.step_in_backward and s.diloco is not None,
         lambda s: _IN_BACKWARD + "and DiLoCo's inner steps are local to each rank: leave "
                   "step_in_backward out"),
    Rule(lambda s: s.step_in_backward and s.offload is not None,
         lambda s: _IN_BACKWARD + f"and offload={s.offload.what!r} steps on the host after "
                   "backward; leave one of them out"),
)

COMBINATIONS += (
    Rule(lambda s: s.base_dtype is not None and not s.reshards,
         lambda s: f"base_dtype={s.base_dtype!r} keeps the frozen base in 4-bit shards that "
                   "each layer gathers while it computes, which is zero3's way: use "
                   "strategy='zero3'"),
    Rule(lambda s: s.base_dtype is not None and s.offload is not None and s.offload.params,
         lambda s: f"base_dtype={s.base_dtype!r} with offload='params': the 4-bit shards stay "
                   "on the device; leave offload='params' out"),
)

# What a step redone on another group cannot yet carry over exactly, under continue mode.
CONTINUE_MODE: tuple[Rule, ...] = (
    Rule(lambda s: s.diloco is not None,
         lambda s: _CONTINUE + "strategy=DiLoCo is not supported yet: its inner steps carry "
                   "state from one sync to the next" + _RESTART),
    Rule(lambda s: s.precision.loss_scaling,
         lambda s: _CONTINUE + "precision='fp16' is not supported yet: the loss scale each "
                   "rank sends depends on the number of ranks; use precision='bf16'" + _RESTART),
    Rule(lambda s: s.base_dtype is not None,
         lambda s: _CONTINUE + f"base_dtype={s.base_dtype!r} is not supported yet: its gathers "
                   "are not redone on a new group" + _RESTART),
    Rule(lambda s: s.step_in_backward,
         lambda s: _CONTINUE + "step_in_backward=True is not supported: a step lost in the "
                   "middle of a backward would leave some units stepped" + _RESTART),
    Rule(lambda s: s.staleness is not None or s.compression is not None,
         lambda s: _CONTINUE + ("staleness=1" if s.staleness is not None else
                                "compression=PowerSGD") + " is not supported yet: its state "
                   "spans steps, and a lost step would leave the ranks' states apart" + _RESTART),
)


# -- each option alone ----------------------------------------------------------------------------
def _bucket_mb(bucket_mb) -> float:
    if not (isinstance(bucket_mb, (int, float)) and not isinstance(bucket_mb, bool)
            and math.isfinite(bucket_mb) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a positive, finite number of MiB (default "
                         f"25), not {bucket_mb!r}")
    return float(bucket_mb)


def _comm_dtype(comm_dtype) -> torch.dtype | None:
    try:
        return COMM_DTYPES[comm_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"comm_dtype must be None, torch.bfloat16, torch.float16 or "
                         f"torch.float32 (or 'bf16', 'fp16', 'fp32'), not {comm_dtype!r}"
                         ) from None


def _output_dtype(output_dtype) -> torch.dtype | None:
    if output_dtype is not None and not (isinstance(output_dtype, torch.dtype)
                                         and output_dtype.is_floating_point):
        raise ValueError(f"output_dtype={output_dtype!r}: a floating dtype such as "
                         "torch.float32 (the default), or None to keep the compute dtype")
    return output_dtype


def _replicas_every(every) -> int | None:
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"check_replicas_every={every!r}: a number of optimizer steps, 1 or "
                         "more, or None (no check)")
    return every


def _base_dtype(base_dtype) -> str | None:
    if base_dtype not in (None, "nf4"):
        raise ValueError(f"base_dtype={base_dtype!r}: 'nf4' (the frozen base weights in 4-bit "
                         "NF4 shards, QLoRA's) or None (the default: as the model holds them)")
    return base_dtype


def _step_in_backward(flag) -> bool:
    if not isinstance(flag, bool):
        raise ValueError(f"step_in_backward={flag!r}: True (each unit stepped as soon as its "
                         "gradient is reduced, in backward) or False (the default)")
    return flag


def _on_nonfinite(mode) -> str | None:
    if mode not in NONFINITE_MODES:
        raise ValueError(f"on_nonfinite={mode!r}: one of 'raise' (the default), "
                         "'skip', 'warn' or None (no check)")
    return mode


def gathering_of(prefetch, max_gathered_mb, reshard_after_forward) -> Gathering:
    """zero3's gathering options, as given (prefetch None: not given; the rows refuse them for
    another strategy, and `Spec.of` fills in the default)."""
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int)
                                 or prefetch < 0):
        raise ValueError(f"prefetch={prefetch!r}: how many blocks to gather ahead, 0 or more "
                         "(default 1)")
    if max_gathered_mb is not None and not (
            isinstance(max_gathered_mb, (int, float)) and not isinstance(max_gathered_mb, bool)
            and math.isfinite(max_gathered_mb) and max_gathered_mb > 0):
        raise ValueError(f"max_gathered_mb={max_gathered_mb!r}: a positive number of MiB, or "
                         "None (no bound)")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: True or False")
    return Gathering(prefetch, max_gathered_mb, reshard_after_forward)


def _staleness(staleness) -> Staleness | None:
    if isinstance(staleness, bool) or staleness not in (0, 1):
        raise ValueError(f"staleness={staleness!r}: 0 (the default: every step applies its own "
                         "averaged gradient) or 1 (step t applies step t-1's, so its averaging "
                         "has a whole step to finish)")
    return Staleness(int(staleness)) if staleness else None


def _compression(compression) -> PowerSGD | None:
    if compression is not None and not isinstance(compression, PowerSGD):
        raise TypeError(f"compression={compression!r}: pass px.PowerSGD(rank=..., "
                        "start_step=...) or None")
    return compression


def _offload(offload) -> Offload | None:
    if offload is None:
        return None
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r}: 'optimizer' (masters and optimizer state in host "
                         "memory, stepped there), 'params' (zero3: its parameter shards too) or "
                         "None")
    return Offload(offload)
