"""Memory per device: model states by the ZeRO layout, plus the engine's working buffers.

[Note: Model states]
Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(arXiv:1910.02054), Sec. 3.1 and 5: with Psi parameters, N data-parallel ranks, weights of w
bytes, gradients of g bytes and K bytes of optimizer state per parameter,

    ddp    (w + g + K) Psi          zero1  (w + g) Psi + K Psi / N
    zero2  w Psi + (g + K) Psi / N  zero3  (w + g + K) Psi / N

Mixed precision Adam (bf16/fp16 weights and gradients, fp32 master + two moments): w = g = 2,
K = 12, so ddp costs 16 Psi. Pure fp32 Adam: w = g = 4 and K = 8 (the fp32 weights are the
master). "bf16" keeps everything, moments included, in bf16: 2 + 2 + 4 = 8 Psi.

[Note: Engine buffers]
`buffers_bytes` is what phalanx's engine (sharding.py, replicate.py, reducer.py) holds beyond
those model states at its peak, modelled from its code:
- the master's fp32 gradient, when it cannot be a view of the reduced bucket: 4 Psi (ddp) or
  4 Psi / N (sharded) under mixed precision; with fp32 on NCCL (reduce-scatter into a separate
  shard) 4 Psi / N for zero1. In zero2/zero3 it replaces the sharded gradient, so only the
  difference to g Psi / N is added.
- gradient buckets still alive at the end of backward: the engine (reducer.py) waits for every
  bucket's collective when backward ends, so under zero2 all buckets exist at once then: the
  full gradients, minus the shard already counted. zero3 is modelled with the gradients of
  two gather units in flight.
- communication copies: with a `comm_dtype` different from the gradients, one copy of every
  bucket in that dtype; with reduce-scatter, the received shards.
- zero3: two gather units of full parameters (the one in use and the one prefetched). The
  zero3 engine is not written yet; this is the layout it is meant to have.

[Note: Optimizer step working memory]
Adam's update makes temporaries (the square root of the second moment, then its quotient).
PyTorch's foreach implementation, the default on GPU, makes them for all of a param group's
tensors at once: one state-sized tensor over everything this rank steps. Its single-tensor
implementation, the default on CPU, makes two of the largest tensor stepped (for phalanx's
sharded engine a unit's master shard, see layout.py). The step comes after backward has freed
the activations, so the peak is model states + buffers + the larger of activations and this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Precision", "PRECISIONS", "OPTIMIZERS", "STRATEGIES", "optimizer_state_elements",
           "ModelStates", "model_states", "buffer_bytes", "step_working_bytes"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Precision:
    name: str
    weight: int       # bytes per parameter of the weights the model computes with
    grad: int         # bytes per gradient element
    master: int       # bytes of a separate fp32 master copy (0: the weights are the master)
    state: int        # bytes per optimizer-state element (moments, momentum)
    activation: int   # bytes per activation element
    description: str

    @property
    def mixed(self) -> bool:
        return self.master > 0


PRECISIONS = {
    "fp32": Precision("fp32", 4, 4, 0, 4, 4, "fp32 weights, gradients and optimizer state"),
    "bf16-mixed": Precision("bf16-mixed", 2, 2, 4, 4, 2,
                            "bf16 weights and gradients, fp32 master weights and optimizer state "
                            "(px.prepare precision='bf16')"),
    "fp16-mixed": Precision("fp16-mixed", 2, 2, 4, 4, 2,
                            "fp16 weights and gradients, fp32 master weights and optimizer state, "
                            "dynamic loss scaling (px.prepare precision='fp16')"),
    "bf16": Precision("bf16", 2, 2, 0, 2, 2,
                      "everything in bf16, optimizer moments included, no master copy"),
}

# Optimizer-state elements per trainable parameter, for element-wise optimizers.
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1, "adafactor": None}


def _adafactor_elements(shapes) -> int:
    """Adafactor (Shazeer & Stern 2018, arXiv:1804.04235) without momentum keeps, for a matrix
    of shape (..., r, c), a row and a column second-moment vector (r + c per matrix) and for a
    vector one value per element."""
    total = 0
    for shape in shapes:
        if len(shape) >= 2:
            total += math.prod(shape[:-2]) * (shape[-2] + shape[-1])
        else:
            total += math.prod(shape)
    return total


def optimizer_state_elements(optimizer: str, trainable: int, shapes=None, nominal=None) -> int:
    """Elements of optimizer state. For Adafactor without shapes (a bare count) the stand-in
    square matrices of `nominal` (hidden size h: 2/h state per parameter) are used."""
    per_param = OPTIMIZERS[optimizer]
    if per_param is not None:
        return per_param * trainable
    if shapes is not None:
        return _adafactor_elements(shapes)
    return math.ceil(trainable * 2 / nominal.hidden)


@dataclass(frozen=True)
class ModelStates:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _shard(nbytes: int, n: int) -> int:
    return math.ceil(nbytes / n)


def model_states(strategy: str, precision: Precision, params: int, trainable: int,
                 state_elements: int, world: int) -> ModelStates:
    """Bytes per device of weights, gradients and optimizer state (see [Note: Model states])."""
    w = precision.weight * params
    g = precision.grad * trainable
    k = precision.master * trainable + precision.state * state_elements
    if strategy == "ddp":
        return ModelStates(w, g, k)
    if strategy == "zero1":
        return ModelStates(w, g, _shard(k, world))
    if strategy == "zero2":
        return ModelStates(w, _shard(g, world), _shard(k, world))
    if strategy == "zero3":
        return ModelStates(_shard(w, world), _shard(g, world), _shard(k, world))
    raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")


def buffer_bytes(strategy: str, precision: Precision, trainable: int, world: int,
                 reduce_scatter: bool, comm_bytes: int | None, largest_unit: int) -> dict:
    """The engine's working memory by kind (see [Note: Engine buffers]); values in bytes."""
    if world == 1 and strategy != "ddp":
        reduce_scatter = False
    n = world if strategy != "ddp" else 1
    g_full = precision.grad * trainable
    sharded_grads = strategy in ("zero2", "zero3")
    out = {"master_grad": 0, "grad_buckets": 0, "comm_copies": 0, "gathered_params": 0}
    if precision.mixed:
        master_grad = _shard(4 * trainable, n)
        out["master_grad"] = master_grad - (_shard(g_full, n) if sharded_grads else 0)
    elif precision.name == "fp32" and strategy == "zero1" and (reduce_scatter or comm_bytes):
        out["master_grad"] = _shard(4 * trainable, n)
    if strategy == "zero2" and world > 1:
        out["grad_buckets"] = g_full - _shard(g_full, world)
    elif strategy == "zero3" and world > 1:
        out["grad_buckets"] = min(g_full, 2 * precision.grad * largest_unit)
    if comm_bytes is not None and comm_bytes != precision.grad:
        out["comm_copies"] = comm_bytes * trainable
    elif reduce_scatter and strategy != "ddp" and world > 1:
        out["comm_copies"] = _shard(g_full, world)
    if strategy == "zero3":
        out["gathered_params"] = 2 * precision.weight * largest_unit
    return out


def step_working_bytes(optimizer: str, strategy: str, precision: Precision, world: int,
                       trainable: int, largest_param: int, largest_unit: int,
                       foreach: bool) -> int:
    """Temporaries of one optimizer step (see [Note: Optimizer step working memory])."""
    if optimizer not in ("adam", "adamw", "adafactor") or trainable == 0:
        return 0
    n = 1 if strategy == "ddp" else world
    if strategy == "ddp" and not precision.mixed:   # the model's own parameters are stepped
        largest, total = largest_param, trainable
    else:                                            # flat master shards, one per unit
        largest, total = _shard(largest_unit, n), _shard(trainable, n)
    state = 4 if precision.mixed else precision.state
    return state * total if foreach else 2 * state * largest
