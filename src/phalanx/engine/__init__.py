"""The engine behind a prepared model, and the protocol the rest of phalanx calls it through.

Layout: policy.py (a strategy as a residency row), units.py (which parameters form a unit, and
under zero3 where it is gathered), buckets.py (flat gradient storage), flat.py (a unit: owned
shard, master pieces, unshard, its gradients reduced and handed to the step), flat_engine.py
(the engine, which owns the parts that follow, each a class of its own: reducer.py (hooks,
launch order, end of backward), state.py (its masters as the rest of phalanx reads them, and
what a peer asks for), stepping.py (the step, a run of units at a time), zero3.py (gathering
and freeing units around their forward and backward; zero3_prefetch.py what it gathers ahead,
zero3_release.py when a unit holding frozen parameters is freed in backward, zero3_roots.py
checks that the ranks gather alike and guards modules used outside their root, zero3_replay.py
the log of its gathers that a failed pass makes again), vote.py (a step that raised on one rank
dropped on every rank), generations.py (what an engine does across continue mode's
generations), optim.py (adopting the optimizer)), remote.py (a peer's shards read by a rank
alone), amp.py (torch.amp's GradScaler routed to the engine's reduced gradients), offload.py
(masters and optimizer state in host memory, stepped there), clipping.py (the global norm;
torch's clip_grad_norm_ routed to it), part.py (a feature beside the strategy, as checkpoints
see it; every kind of one in part_kinds.py), powersgd.py (low-rank gradient
compression in the reducer; its request in powersgd_config.py), delayed.py (`staleness=1`),
diloco.py (DiLoCo's outer step), hybrid.py (`shard_size`: sharded within groups, replicated
across them).
"""

from __future__ import annotations

from typing import ContextManager, Protocol

import torch

from .clipping import route_torch_clip
from .flat_engine import Features, FlatEngine, UnitOptions
from .optim import optimizer_state_dict
from .optimizer_kinds import element_wise, matrix_wise
from .policy import POLICIES, ShardPolicy

__all__ = ["Engine", "EngineSpec", "FlatEngine", "build_engine", "POLICIES", "ShardPolicy",
           "element_wise", "matrix_wise", "optimizer_state_dict"]


class Engine(Protocol):
    """What the rest of phalanx uses of an engine, and nothing else: the prepared module
    (model/prepared.py), px.prepare and px.from_safetensors (model/), checkpoints
    (checkpoint/), continue mode (model/relayout.py, continuing/joining.py) and the planner's
    report of a run (planner/layout.py). Every attribute is always there (None where it does
    not apply); tests/test_engine_protocol.py checks that each strategy's engine has them all."""

    params: list[torch.nn.Parameter]
    comm: object         # the Comm it reduces and shards over (a group under shard_size)
    policy: ShardPolicy  # what is sharded and where it lives (policy.py)
    sharded: bool        # the optimizer state is sharded over more than one rank
    units: list          # the units that learn, in stepping order (flat.py's FlatUnit)
    require_backward_grad_sync: bool
    reshards: bool   # zero3: parameters exist only while their unit computes (zero3.py)
    nonfinite: object  # the NonFiniteWatch of faults/nonfinite.py, or None
    gatherer: object   # zero3's UnitGatherer (zero3.py), or None
    steps: object      # the model's StepCounter (records.py)
    vote: object       # the StepVote of vote.py (the prepared model marks what it cannot vote)
    replicas: object     # shard_size's average across shard groups (hybrid.py), or None
    delayed: object      # staleness=1's DelayedGrads (delayed.py), or None
    compression: object  # PowerSGD's reducer (powersgd.py), or None
    host_link: object    # offload's HostLink (offload.py), or None
    remote: object       # the shard service other ranks read from (remote.py), or None
    remote_id: object    # this engine's name in that service, or None

    def no_sync(self) -> ContextManager: ...
    def backward_started(self, grad=None) -> None: ...
    def before_forward(self, grad: bool = True) -> None: ...
    def forward_raised(self, exc: BaseException) -> None: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...
    def master_values(self) -> dict[int, torch.Tensor] | None: ...
    def full_master_values(self) -> dict[int, torch.Tensor]: ...
    def open_params(self) -> list: ...
    def close_params(self, opened: list) -> None: ...
    def load_masters(self, values: dict[int, torch.Tensor]) -> None: ...
    def master_pieces(self) -> dict: ...
    def held_pieces(self) -> dict: ...
    def publish_masters(self) -> None: ...
    def watch_steps(self, optimizer, fn) -> None: ...
    def guard_steps(self, optimizer, before) -> None: ...
    def groups(self) -> list: ...
    def names_across(self) -> set: ...
    def parts(self) -> list: ...  # the features it runs beside its strategy (compression, delayed)
    # continue mode (generations.py)
    def laid_out_for(self, comm) -> bool: ...
    def release(self) -> None: ...
    def elastic_state(self) -> dict: ...
    def set_elastic_state(self, state: dict | None) -> None: ...


class EngineSpec(Protocol):
    """What the engine reads of px.prepare's resolved options (model/spec.py's `Spec`, which
    stands a floor above and is handed down whole)."""

    policy: ShardPolicy    # the strategy's residency row, with offload's places (policy.py)
    bucket_mb: float       # a unit's size (units.py)
    gathering: object      # zero3's Gathering (its `options()`: zero3.py's), or None
    staleness_steps: int   # 1: each step applies the previous step's average (delayed.py)
    compression: object    # a px.PowerSGD (powersgd.py), or None
    step_in_backward: bool  # each unit stepped as its gradient is reduced (stepping.py)


def build_engine(module, optimizer, comm, spec: EngineSpec, precision, *, block_classes=None,
                 replicas=None, buffers=None, nonfinite=None, steps=None) -> Engine:
    """The engine `spec` asks for over `comm`. precision: the runtime Precision
    (model/precision.py: compute dtype, loss scaler); block_classes: the classes whose
    instances are the repeated blocks (units.py); replicas: shard_size's average across shard
    groups, `comm` being the group (hybrid.py); buffers: what keeps the buffers equal at the
    end of each backward that synchronises (model/buffers.py), or None; nonfinite: the
    NonFiniteWatch (faults/nonfinite.py), or None; steps: the model's StepCounter."""
    policy = spec.policy
    gather = spec.gathering.options() if spec.gathering is not None else None
    engine = FlatEngine(module, optimizer, comm, policy, precision=precision,
                        units=UnitOptions(spec.bucket_mb, block_classes, gather),
                        features=Features(spec.staleness_steps, replicas, spec.compression,
                                          buffers, spec.step_in_backward),
                        nonfinite=nonfinite, steps=steps)
    if policy.shards_grads(comm.world) or precision.loss_scaler is not None \
            or spec.staleness_steps or spec.step_in_backward:
        route_torch_clip(engine)
    return engine
