"""Memory per device: model states by the ZeRO layout, plus the engine's working buffers.

[Note: Model states]
Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(arXiv:1910.02054), Sec. 3.1 and 5: with Psi parameters, N data-parallel ranks, weights of w
bytes, gradients of g bytes and K bytes of optimizer state per parameter,

    ddp    (w + g + K) Psi          zero1  (w + g) Psi + K Psi / N
    zero2  w Psi + (g + K) Psi / N  zero3  (w + g + K) Psi / N

Mixed precision Adam ("bf16"/"fp16": bf16/fp16 weights and gradients, fp32 master + two
moments): w = g = 2, K = 12, so ddp costs 16 Psi. Pure fp32 Adam: w = g = 4 and K = 8 (the fp32
weights are the master). "bf16-true" keeps everything, moments included, in bf16: 2 + 2 + 4 =
8 Psi. (The names are phalanx.spec.precisions', shared with px.prepare.)
Frozen parameters (a LoRA model's base, `requires_grad=False`) have weights only: w bytes each,
whole on every rank under ddp, zero1 and zero2, sharded 1/N under zero3; no gradient, master or
optimizer state. With Psi_t trainable of Psi parameters, g and K multiply Psi_t.
zero3 under mixed precision keeps no compute-dtype copy of a trainable parameter's shard: the
fp32 master (in K) is the shard, cast into the gathered buffer at each gather (engine/flat.py),
so its row is (g + K) Psi_t / N + w Psi_f / N, 14/N per parameter with Adam where the ZeRO
paper counts 16/N. (On one rank zero3 shards nothing and keeps its parameters whole, as zero2
does; offloaded, a compute-dtype shard stays on the device: offload.py.)
Shards are cut per unit: each unit's trainable and frozen segments are padded to a multiple of
N (engine/flat.py), so a rank owns the sum over units of ceil(unit / N) elements; given the
engine's units (layout.py), the plan counts that, and the first rank's (the largest) share of
the optimizer state.

[Note: Low-bit optimizer state and a 4-bit base]
`optimizer="adamw8bit"` and `"adamw4bit"` are AdamW with its two moments stored block-wise
quantized, as torchao's low-bit optimizers keep them (AdamW8bit: one byte per element and one
fp32 scale per block of 256; AdamW4bit: half a byte and one fp32 scale per block of 128), so K
above is the master's bytes plus 2 x (1 + 4/256) = 2.03 bytes per trainable parameter (8-bit)
or 2 x (0.5 + 4/128) = 1.06 (4-bit), whatever the precision; sharded on block bounds, a shard
holds its own blocks' scales. The step works on an fp32 copy of the moments of what it steps
(see [Note: Optimizer step working memory]).
`base_dtype="nf4"` (QLoRA: Dettmers et al. 2023, arXiv:2305.14314) stores the frozen weights of
nn.Linear layers as torchao's NF4: half a byte per element, one int8 scale per block of 64 and
one fp32 scale per 256 of those (0.5 + 1/64 + 4/16384 bytes per element), each a whole number
of 64 x 256 elements (model/nf4_base.py leaves the others as they are); other frozen
parameters (norms, embeddings) and the trainable ones stay in the compute dtype. px.prepare
takes it under zero3 alone: each rank holds and gathers those bytes (a quarter of bf16's), and
a weight is dequantized only while its layer computes: its compute-dtype copy beside its
gathered 4-bit bytes (`dequantized` below: the largest such weight's, alive while forward or
backward computes).

[Note: Engine buffers]
`buffers_bytes` is what phalanx's engine (engine/flat_engine.py, flat.py, reducer.py, buckets.py)
holds beyond those model states, modelled from its code and checked against the engine by
tests/test_plan_memory.py and against measured peaks by benchmarks/plan_vs_measured.py.
The reduced gradients themselves are the formula's g: they stay in the compute dtype, as the
owned slice of the kept bucket (ddp, zero1) or as a persistent shard (zero2), so there is no
separate fp32 gradient between steps.
- grad_pool (zero2, zero3): the full-gradient buckets of the units that borrow (more than one
  parameter, or one whose size the world does not divide: engine/units.py `borrows`) are lent
  from a pool of two buffers, each the size of the largest such unit plus the world size (one
  reduced but unfinished, one filling), made up front. Kept. A unit of one parameter is
  reduced in the gradient autograd made (engine/buckets.py), so zero2 holds, besides the one
  being made (grad_staging), one such unit's gradients in flight (unit_grads).
- comm_buffers: with a `comm_dtype` other than the compute dtype, the sharded engine keeps one
  low-precision copy of every unit. Kept.
- comm_copies: what exists until a bucket's collective is finished: fp32 ddp's compressed
  copies (every bucket, at the end of backward) and the shards reduce-scatter receives (zero2
  on NCCL; zero1 keeps full gradients and all-reduces).
- grad_staging: autograd makes each parameter's gradient as a fresh tensor, which the engine
  then copies into its bucket; the largest parameter's gradient exists twice for a moment
  (zero2 and zero3 reduce a lone parameter's in that tensor: the one being made).
- dequantized: with a 4-bit base, the compute-dtype copy of the weight computing (the largest
  4-bit weight's elements), alive in forward and backward.
- gathered_params (zero3): the full parameters gathered at once (planner/layout.py's
  `zero3_gathering`): the units rooted at the model itself (tied embeddings and head), which
  stay gathered through the forward and into backward, plus the root computing and the one
  prefetched beside it, the most two consecutive roots hold in the order they run (a block
  with the head or the embedding, never those two together); unit_grads: the full gradients
  of two consecutive units in flight, in backward's order (the one reduced and the one being
  made), of units that do not borrow (a borrowing unit's are in the pool); under zero3 the
  gradient autograd makes of a lone parameter is that unit's, so grad_staging there is the
  largest parameter of a unit that borrows (copied into the pool).

[Note: Optimizer step working memory]
Adam's update makes temporaries (the square root of the second moment, then its quotient).
PyTorch's foreach implementation, the default on GPU, makes them for all the tensors of one
call at once: one state-sized tensor over everything stepped. Its single-tensor
implementation, the default on CPU, makes two of the tensor being stepped while the previous
tensor's last one is still held: up to about three of the largest tensor stepped.
fp32 ddp steps the model's own parameters in one call, and so does phalanx's flat engine when
the gradients already are in the master dtype (fp32: every unit's master pieces in one call).
Under mixed precision the flat engine makes the fp32 gradients of a run of consecutive units
at a time (up to four buckets' worth: engine/units.py, step_runs and step_run_bytes, shared
with the engine; see [Note: fp32 gradients a few units at a time] in engine/units.py),
steps that run's master pieces in one call and drops the gradients after it. Its step's
working memory is then the largest, over runs, of the run's fp32 gradients (4 bytes per owned
element) plus the optimizer's temporaries for the run's tensors (the single-tensor
temporaries are modelled on each unit as one tensor, an upper bound, since a unit's pieces
are stepped one parameter at a time).
"bf16-true" keeps no master: the step upcasts the parameters, gradients and optimizer state of
a batch of pieces of at most 2^22 elements at a time to fp32 ([Note: a cap on a piece] in
engine/flat.py), steps them and rounds them back ([Note: bf16-true's step] in
engine/rounding.py): 4 + 4 bytes per element and 4 per state element of the batch, with the
optimizer's temporaries in fp32. A low-bit optimizer's moments are dequantized to fp32 one
tensor at a time, a piece of at most 2^22 elements (4 bytes per state element of the largest;
its own compiled update makes no temporaries beyond them).
With `step_in_backward=True` each unit is stepped alone, as soon as its gradient is reduced
([Note: the step in backward] in engine/stepping.py), so the runs are single units, and the
step happens while backward runs (see [Note: Peak]).

[Note: Peak]
Not everything is alive at once. Model states and the kept buffers always are; on top of
them the peak is the largest of three moments:
  backward start   every activation saved, the loss's gradients, a gradient being staged, and
                   (zero3) the gathered units and their gradients in flight;
  end of backward  activations freed; communication copies not yet finished;
  optimizer step   the step's working memory (one unit's fp32 gradient, temporaries).
Backward frees activations from the last layer as it makes the last layer's gradients, so
between the first two moments one shrinks as the other grows. `benchmarks/plan_vs_measured.py`
checks the result against measured peaks.
With `step_in_backward=True` the optimizer step is a moment of backward: each unit is stepped
while the units before it are still computing, so the step's working memory (one unit's) adds
to what backward holds: the start of backward's terms, less the loss's memory (its log-softmax
and its gradients, freed by the loss's backward before any weight has a gradient to reduce),
an upper bound since backward frees activations as it goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engine.flat import PIECE_CAP
from ..engine.policy import SHARD, ShardPolicy
from ..engine.units import step_runs
from ..spec.precisions import PrecisionSpec

__all__ = ["OPTIMIZERS", "MATRIX_WISE", "QUANTIZED_STATES", "NF4_BYTES", "NF4_CHUNK",
           "state_bytes_of",
           "optimizer_state_elements", "ModelStates", "model_states", "buffer_bytes",
           "step_working_bytes", "peak_bytes", "WholeTerms", "whole_terms"]

# Optimizer-state elements per trainable parameter, for element-wise optimizers (and Muon's
# momentum); Adafactor's depend on the shapes.
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1, "adafactor": None, "muon": 1,
              "adamw8bit": 2, "adamw4bit": 2}

# Block-wise quantized optimizer state (see [Note: Low-bit optimizer state and a 4-bit base]):
# (bytes per element, elements per fp32 scale), torchao's AdamW8bit and AdamW4bit.
QUANTIZED_STATES = {"adamw8bit": (1, 256), "adamw4bit": (0.5, 128)}

# torchao's NF4: 4 bits per element, an int8 scale per block of 64, an fp32 scale per 256 scales;
# a weight is stored so when it is a whole number of those 64 x 256 elements (model/nf4_base.py).
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
NF4_CHUNK = 64 * 256


def state_bytes_of(optimizer: str, precision: PrecisionSpec) -> float:
    """Bytes per optimizer-state element: a quantized optimizer's own, whatever the precision;
    otherwise the precision's (fp32 under mixed precision, else the parameters' dtype)."""
    if optimizer in QUANTIZED_STATES:
        per, block = QUANTIZED_STATES[optimizer]
        return per + 4 / block
    return precision.state_bytes

# The matrix-wise optimizers (engine/optimizer_kinds.py) and which parameters, by shape, each
# steps whole on an owner rank under a sharded optimizer (engine/owners.py): Muon its
# matrices, Adafactor every parameter (its update is scaled by the parameter's RMS).
MATRIX_WISE = {"muon": lambda shape: len(shape) == 2, "adafactor": lambda shape: True}


@dataclass(frozen=True)
class WholeTerms:
    """What a matrix-wise optimizer adds on n ranks of a sharded optimizer (see [Note: whole
    parameters on owner ranks] in engine/owners.py): `payload` bytes a rank hands to the
    owners' all-to-alls per step (its slices of every whole parameter's gradient and master,
    2E/n, and its owned parameters' slices back, E/n, in the master dtype), and
    `working` bytes an owner holds during the step beyond its shard: the largest whole
    parameter's gradient and master, and the optimizer's temporaries for it (Muon: the update in
    the master dtype, two bf16 Newton-Schulz iterates and two min(r, c)^2 bf16 Gram matrices;
    Adafactor: the update)."""
    payload: int
    working: int


def whole_terms(optimizer: str, shapes, trainable: int, master_bytes: int, n: int,
                nominal=None) -> WholeTerms | None:
    """The owners' terms (None for an element-wise optimizer, or on one rank). Without shapes
    (a bare count) the stand-in square matrices of `nominal` are used."""
    rule = MATRIX_WISE.get(optimizer)
    if rule is None or n <= 1:
        return None
    if shapes is None:
        h = nominal.hidden
        shapes = [(h, h)] * max(1, trainable // (h * h))
    whole = [tuple(shape) for shape in shapes if rule(shape)]
    if not whole:
        return None
    elements = sum(math.prod(shape) for shape in whole)
    largest = max(whole, key=math.prod)
    numel = math.prod(largest)
    if optimizer == "muon":
        k = min(largest[-2:]) if len(largest) >= 2 else 1
        temporaries = numel * master_bytes + 2 * 2 * numel + 2 * 2 * k * k
    else:
        temporaries = numel * master_bytes
    return WholeTerms(payload=-(-3 * elements * master_bytes // n),
                      working=2 * numel * master_bytes + temporaries)


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


def model_states(policy: ShardPolicy, precision: PrecisionSpec, params: int, trainable: int,
                 state_elements: int, world: int, owned: tuple | None = None,
                 state_bytes: float | None = None,
                 frozen_bytes: float | None = None) -> ModelStates:
    """Bytes per device of weights, gradients and optimizer state under the residency row
    `policy` (see [Note: Model states]). `params` counts every parameter, frozen ones included;
    `trainable` those that learn. `owned`: (trainable, frozen, optimizer-state) elements of the
    shards a rank owns, as the engine pads them per unit (layout.py's `owned_elements`); None:
    1/N of the bytes. `state_bytes`: per optimizer-state element (None: the precision's; see
    `state_bytes_of`); `frozen_bytes`: per frozen element, on average (None: the compute
    dtype's; less with a 4-bit base)."""
    w, g = precision.weight_bytes, precision.grad_bytes
    sb = precision.state_bytes if state_bytes is None else state_bytes
    fb = w if frozen_bytes is None else frozen_bytes
    k = math.ceil(precision.master_bytes * trainable + sb * state_elements)
    frozen = params - trainable
    held = fb * frozen + (0 if precision.mixed else w * trainable)  # zero3's between uses
    if owned is None:
        shard_g, shard_k = _shard(g * trainable, world), _shard(k, world)
        shard_w = _shard(held, world)
    else:
        t, f, s = owned
        shard_g = g * t
        shard_k = math.ceil(precision.master_bytes * t + sb * s)
        shard_w = math.ceil(fb * f + (0 if precision.mixed else w * t))
    # zero3 on one rank keeps its parameters whole; a SHARD of gradients or optimizer state on
    # one rank is all of it, as the engine pads it
    return ModelStates(shard_w if policy.reshards(world) else math.ceil(w * trainable
                                                                         + fb * frozen),
                       shard_g if policy.grads is SHARD else g * trainable,
                       shard_k if policy.optimizer is SHARD else k)


def buffer_bytes(policy: ShardPolicy, precision: PrecisionSpec, trainable: int, world: int,
                 reduce_scatter: bool, comm_bytes: int | None, largest_unit: int,
                 largest_param: int = 0, gathered_numel: int | None = None,
                 borrowing: tuple[int, int] | None = None, dequantized: int = 0,
                 in_flight: tuple[int, int] | None = None) -> dict:
    """The engine's working memory by kind under the residency row `policy` (see [Note: Engine
    buffers]); values in bytes. `borrowing`: (largest unit that borrows from the pool,
    largest that does not), in elements (engine/units.py); None: every unit borrows, the
    largest being `largest_unit`. `gathered_numel`: zero3's elements gathered at once (with a
    4-bit base, in elements of the compute dtype that weigh as much); `dequantized`: bytes of
    the compute-dtype copy of a 4-bit unit computing. `in_flight` (zero3, from the units in
    backward's order): (elements of the gradients of two consecutive units that do not
    borrow, the most at once; of the largest parameter of a unit that does), else None: two
    of the largest unit's and the largest parameter's."""
    # Only strategies that shard gradients reduce-scatter (zero1 keeps full gradients, so it
    # all-reduces whatever the backend: engine/policy.py).
    sharded_grads = policy.shards_grads(world)
    reduce_scatter = reduce_scatter and sharded_grads
    g = precision.grad_bytes
    g_full = g * trainable
    compressed = comm_bytes is not None and comm_bytes != precision.weight_bytes
    out = dict.fromkeys(("grad_pool", "grad_shard", "comm_buffers", "comm_copies",
                         "gathered_params", "unit_grads"), 0)
    out["dequantized"] = dequantized
    out["grad_staging"] = g * largest_param
    pooled, lone = (largest_unit, 0) if borrowing is None else borrowing
    if sharded_grads and pooled:
        out["grad_pool"] = 2 * g * (pooled + world)
    if policy.reshards(world):
        if in_flight is None:
            out["unit_grads"] = min(g_full, 2 * g * largest_unit)
        else:
            out["unit_grads"], out["grad_staging"] = g * in_flight[0], g * in_flight[1]
        out["gathered_params"] = math.ceil(precision.weight_bytes * (
            2 * largest_unit if gathered_numel is None else gathered_numel))
    elif sharded_grads:
        out["unit_grads"] = g * lone
    comm_elem = comm_bytes if compressed else g
    if compressed and (policy.optimizer is SHARD or precision.mixed):
        out["comm_buffers"] = comm_bytes * trainable
    elif compressed:
        out["comm_copies"] = comm_bytes * trainable
    if reduce_scatter:  # the received shards of the (at most two) buckets in flight
        out["comm_copies"] += _shard(comm_elem * min(trainable, 2 * largest_unit), world)
    return out


def _temporaries(optimizer: str, state: int, stepped: list[int], foreach: bool,
                 fused: bool = False) -> int:
    """Bytes the optimizer's own update makes while stepping `stepped` in one call (a fused
    kernel makes none)."""
    if optimizer not in ("adam", "adamw", "adafactor") or not stepped or fused:
        return 0
    if foreach:
        return state * sum(stepped)
    # two temporaries of the tensor being stepped, while the previous one's result is still
    # held by the loop variable that the new result will replace
    return state * max(2 * cur + prev for prev, cur in zip([0] + stepped[:-1], stepped))


def _upcasts(precision: PrecisionSpec) -> bool:
    """bf16-true: low-precision parameters that are their own masters, stepped on fp32 copies
    (engine/rounding.py)."""
    return precision.compute_dtype is not None and not precision.mixed


def step_working_bytes(optimizer: str, precision: PrecisionSpec, stepped: list[int],
                       foreach: bool, per_unit: bool = True, run_bytes: int | None = None,
                       fused: bool = False) -> int:
    """Transient bytes of one optimizer step (see [Note: Optimizer step working memory]).
    `stepped` are the element counts of the tensors this rank steps, in the optimizer's order:
    with `per_unit` (the flat engine) one master shard per unit; without it (fp32 ddp) the
    model's parameters. The flat engine steps every unit in one call when the gradients are
    already in the master dtype (fp32), and under mixed precision and bf16-true makes the fp32
    copies for a run of units at a time, up to `run_bytes` of fp32 gradients (engine/units.py:
    step_runs, the same runs the engine steps; 0: each unit alone, as the step in backward
    does). `fused`: the optimizer's fused kernel, which makes no temporaries (the host step of
    offload, planner/offload.py)."""
    if not stepped:
        return 0
    quantized = optimizer in QUANTIZED_STATES
    states = OPTIMIZERS.get(optimizer) or 0  # state elements per element stepped
    upcast = _upcasts(precision)
    if not per_unit or not (precision.mixed or upcast):
        if quantized:  # dequantized one tensor at a time
            return 4 * states * max(stepped)
        return _temporaries(optimizer, precision.state_bytes, stepped, foreach, fused)

    def run_working(run: list[int]) -> int:
        elements = sum(run)
        made = 4 * elements * (2 if upcast else 1)  # the gradients (and parameters) in fp32
        if quantized:  # the moments dequantized a tensor (a piece: at most a cap) at a time
            return made + 4 * states * min(max(run), PIECE_CAP)
        if upcast:
            return made + 4 * states * elements + _temporaries(optimizer, 4, run, foreach, fused)
        return made + _temporaries(optimizer, precision.state_bytes, run, foreach, fused)

    if upcast:  # bf16-true: the fp32 copies a batch of pieces of at most a cap at a time
        pieces = [min(PIECE_CAP, n - i) for n in stepped for i in range(0, n, PIECE_CAP)]
        return max(run_working(batch) for batch in _batches(pieces, PIECE_CAP))
    runs = step_runs([4 * u for u in stepped], run_bytes if run_bytes is not None else 0)
    return max(run_working([stepped[i] for i in run]) for run in runs)


def _batches(sizes: list[int], cap: int) -> list[list[int]]:
    """`sizes` in consecutive batches of at most `cap` (a larger one alone), as the engine's
    bf16-true step takes its pieces (engine/optim.py)."""
    out, batch = [], []
    for n in sizes:
        if batch and sum(batch) + n > cap:
            out.append(batch)
            batch = []
        batch.append(n)
    return out + [batch] if batch else out


def peak_bytes(states_total: int, buffers: dict, activations: int, step_bytes: int,
               in_backward: int | None = None):
    """Peak bytes per device and the moment it happens at (see [Note: Peak]). `in_backward`:
    with the step in backward, the activations still held while units are stepped (the
    activations less the loss's); None: the step comes after backward."""
    kept = buffers["grad_pool"] + buffers["grad_shard"] + buffers["comm_buffers"]
    during = buffers["gathered_params"] + buffers["unit_grads"] + buffers.get("dequantized", 0)
    moments = {
        "backward start": activations + buffers["grad_staging"] + during,
        "end of backward": buffers["comm_copies"] + during,
        "optimizer step": step_bytes if in_backward is None
        else in_backward + buffers["grad_staging"] + during + step_bytes,
    }
    phase = max(moments, key=moments.get)
    return states_total + kept + moments[phase], phase
