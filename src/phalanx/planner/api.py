"""`px.plan(...)`: will it fit, how fast will it run, which strategy to use.

    import phalanx as px
    result = px.plan(params=8e9, gpus=8, gpu_memory="80GB", precision="fp32")
    print(result)                      # the table `phalanx plan` prints
    result["zero3"].total_bytes        # per-device bytes
    result.to_dict()                   # the JSON of `phalanx plan --json`

Pure arithmetic over a model description (model_desc.py): no process group, no GPU, and a
module is only ever built on the meta device.
"""

from __future__ import annotations

import math

import torch

from ..engine.units import borrowing, check_gather_options, step_run_bytes
from .comm import collectives, step_time
from .hardware import LINKS, gpu_spec
from .hybrid import across_groups, check_plan_shard_size
from .layout import unit_sizes, zero3_gathering
from .link import link_report, parse_link
from .memory import (OPTIMIZERS, PRECISIONS, STRATEGIES, buffer_bytes, model_states,
                     optimizer_state_elements, peak_bytes, step_working_bytes)
from .model_desc import ModelDesc, describe, input_from_shape
from .recommend import recommend
from .report import PlanResult, StrategyPlan
from .sizes import parse_bandwidth, parse_bytes
from .trace import trace_module
from .transformer import nominal_shape

__all__ = ["plan"]

_DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16,
           "fp16-mixed": torch.float16}
_COMM_DTYPES = {None: None, "none": None, "bf16": 2, "fp16": 2, "fp32": 4,
                torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def _choice(value, choices, what):
    key = str(value).strip().lower()
    if key not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return key


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def plan(model=None, *, params=None, config=None, gpus: int = 8, nodes: int = 1,
         gpu: str = "h100", gpu_memory=None, peak_tflops: float | None = None, mfu: float = 0.4,
         strategy: str = "all", precision: str = "bf16-mixed", optimizer: str = "adamw",
         batch: int = 1, seq: int | None = None, grad_accum: int = 1,
         activation_checkpointing: bool = False, intra_node_bw=None,
         inter_node_bw="ib-400g", bucket_mb: float = 25.0, comm_dtype=None,
         attention: str = "eager", backend: str = "nccl", input_shape=None,
         input_dtype: str = "float32", headroom: float = 0.1, units: str = "GB",
         blocks=None, prefetch: int = 1, max_gathered_mb: float | None = None,
         reshard_after_forward: bool = True, link=None, powersgd_rank: int = 4,
         sync_every: int = 50, shard_size=None) -> PlanResult:
    """Plan data-parallel training of a model: memory per device, communication and step time
    of each strategy, and which to use. Pure arithmetic: no process group, no GPU, and a module
    is only ever built on the meta device.

        result = px.plan(params=8e9, gpus=8, gpu_memory="80GB", precision="fp32")
        print(result)                      # the table `phalanx plan` prints
        result["zero3"].total_bytes        # per-device bytes
        result.to_dict()                   # the JSON of `phalanx plan --json`

    The model is one of: `params` (a count such as 8e9 or "7.5B"), `config` (a Hugging Face style
    config dict or config.json path), or `model` (an nn.Module, a factory callable, a
    "PATH:FUNCTION" string, or any of the former). `gpus` is per node; the data-parallel world
    is gpus x nodes. `batch` is the micro-batch per device, `seq` its sequence length.
    Bandwidths are GB/s or presets ("nvlink4", "pcie5", "ib-400g", "eth-25g", ...: the list is
    `phalanx plan --help`'s); the intra-node default is the GPU preset's own link.
    `blocks` names the repeated blocks' classes as px.prepare's `blocks=` does (a module or
    factory only); `prefetch`, `max_gathered_mb` and `reshard_after_forward` are px.prepare's
    zero3 options, and change zero3's gathered memory and backward gathers as they change the
    engine's. `link` ("1Gbit", "100Mbit", "25GB/s") is the bandwidth between nodes; it replaces
    `inter_node_bw`, and the plan says whether each strategy is communication-bound over it and
    what PowerSGD rank `powersgd_rank` or DiLoCo `sync_every` would send instead.
    `shard_size` (K, or "node": `gpus`) plans zero1/zero2/zero3 sharded within groups of K
    ranks and replicated across them, the replicas' average timed on the inter-node link.
    Raises ValueError with a one-line message for bad input.
    """
    desc = describe(model, params=params, config=config,
                    make_input=input_from_shape(input_shape, input_dtype) if input_shape else None,
                    blocks=blocks)
    if blocks is not None and desc.module is None:
        raise ValueError("blocks names module classes: give the model as a module or a factory")
    gpus, nodes = _positive_int(gpus, "gpus"), _positive_int(nodes, "nodes")
    batch, grad_accum = _positive_int(batch, "batch"), _positive_int(grad_accum, "grad_accum")
    world = gpus * nodes
    shard_size = check_plan_shard_size(shard_size, world, gpus)
    precision_key = _choice(precision, PRECISIONS, "precision")
    prec = PRECISIONS[precision_key]
    optimizer = _choice(optimizer, OPTIMIZERS, "optimizer")
    strategy = _choice(strategy, STRATEGIES + ("fsdp", "all"), "strategy")
    shown = STRATEGIES if strategy == "all" else ("zero3" if strategy == "fsdp" else strategy,)
    attention = _choice(attention, ("eager", "flash"), "attention")
    backend = _choice(backend, ("nccl", "gloo"), "backend")
    units = {"gb": "GB", "gib": "GiB"}[_choice(units, ("gb", "gib"), "units")]
    if comm_dtype not in _COMM_DTYPES:
        raise ValueError(f"unknown comm_dtype {comm_dtype!r}: choose bf16, fp16 or none")
    comm_bytes = _COMM_DTYPES[comm_dtype.lower() if isinstance(comm_dtype, str) else comm_dtype]
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")

    spec = gpu_spec(gpu)
    memory = parse_bytes(gpu_memory, "GPU memory") if gpu_memory is not None else spec.memory_bytes
    peak = float(peak_tflops) if peak_tflops is not None else spec.peak_tflops(precision_key)
    intra = parse_bandwidth(intra_node_bw if intra_node_bw is not None else spec.link, LINKS,
                            "intra-node bandwidth")
    link_bps = parse_link(link) if link is not None else None
    if link_bps is not None and nodes == 1:
        raise ValueError("link is the bandwidth between nodes, and one node has none to cross: "
                         "give the number of nodes (--nodes 2 or more)")
    inter = link_bps / 1e9 if link_bps is not None else \
        parse_bandwidth(inter_node_bw, LINKS, "inter-node bandwidth")
    bandwidth = intra if nodes == 1 else min(intra, inter)
    notes = list(desc.notes)
    if seq is None:
        seq = 2048
        if desc.transformer is not None and 0 < desc.transformer.learned_positions < seq:
            seq = desc.transformer.learned_positions
    seq = _positive_int(seq, "seq")
    if desc.transformer is not None and 0 < desc.transformer.learned_positions < seq:
        raise ValueError(f"seq {seq} exceeds the model's {desc.transformer.learned_positions} "
                         f"learned positions")

    activations, flops = _activations_and_flops(desc, prec, batch, seq, grad_accum,
                                                activation_checkpointing, attention, notes)
    compute_s = flops / (peak * 1e12 * mfu)
    nominal = nominal_shape(desc.trainable_params) if desc.trainable_shapes is None else None
    state_elements = optimizer_state_elements(optimizer, desc.trainable_params,
                                              desc.trainable_shapes, nominal)
    reduce_scatter = backend == "nccl"
    units_ = unit_sizes(desc.trainable_shapes, desc.trainable_params, prec.weight, bucket_mb,
                        desc.trainable_blocks)
    largest_unit = max(units_)
    gathering = zero3_gathering(desc, prec.weight, bucket_mb, **check_gather_options(
        "zero3", prefetch, max_gathered_mb, reshard_after_forward))
    largest_param = (max((math.prod(s) for s in desc.trainable_shapes), default=0)
                     if desc.trainable_shapes is not None else largest_unit)
    grad_comm = (comm_bytes or prec.grad) * desc.trainable_params

    replicated = not prec.mixed  # ddp without masters: the model's own parameters, as they are

    def _stepped(strategy, n):
        """What the optimizer steps on a rank: fp32 ddp the model's own parameters, otherwise
        one flat master per unit, of the unit's padded shard (ceil(unit / n) elements)."""
        if strategy == "ddp" and replicated and desc.trainable_shapes is not None:
            return [math.prod(s) for s in desc.trainable_shapes]
        n = 1 if strategy == "ddp" else n
        return [-(-u // n) for u in units_]

    def memory_at(strategy, n):
        """Model states, buffers, step temporaries and the peak of `strategy` on n ranks."""
        states = model_states(strategy, prec, desc.params, desc.trainable_params,
                              state_elements, n)
        lent = None if desc.trainable_shapes is None else borrowing(
            [math.prod(s) for s in desc.trainable_shapes], desc.trainable_blocks, prec.weight,
            bucket_mb, n)
        buffers = buffer_bytes(strategy, prec, desc.trainable_params, n, reduce_scatter,
                               comm_bytes, largest_unit, largest_param,
                               gathered_numel=gathering[0], borrowing=lent)
        step_bytes = step_working_bytes(optimizer, prec, _stepped(strategy, n),
                                        foreach=backend == "nccl",
                                        per_unit=not (strategy == "ddp" and replicated),
                                        run_bytes=step_run_bytes(bucket_mb))
        return (states, buffers, step_bytes) + peak_bytes(states.total, buffers, activations,
                                                          step_bytes)

    tokens = world * batch * seq * grad_accum
    plans = {}
    for name in STRATEGIES:
        n = shard_size if shard_size is not None and name != "ddp" else world
        states, buffers, step_bytes, total, phase = memory_at(name, n)
        gathered = prec.weight * (desc.params if name == "zero3" else desc.trainable_params)
        kept = prec.weight * gathering[1] if name == "zero3" else 0
        colls = collectives(name, grad_comm, gathered, n, reduce_scatter, kept)
        within = intra if n < world and gpus % n == 0 else bandwidth  # the group in a node
        t = step_time(colls, n, compute_s, grad_accum, within, activation_checkpointing,
                      units=len(units_), across=across_groups(name, grad_comm, shard_size),
                      replicas=world // n, across_gbps=inter if nodes > 1 else intra)
        plans[name] = StrategyPlan(
            strategy=name, params_bytes=states.params, grads_bytes=states.grads,
            optimizer_bytes=states.optimizer, activations_bytes=activations,
            buffers_bytes=sum(buffers.values()), buffers_detail=buffers,
            step_working_bytes=step_bytes, total_bytes=total, peak_at=phase,
            fits=total <= memory, fits_with_headroom=total <= (1 - headroom) * memory,
            comm_bytes_per_step=t.comm_bytes, comm_payload_bytes=t.payload_by_op,
            comm_time_s=t.comm_s, compute_time_s=t.compute_s, step_time_s=t.step_s,
            step_time_no_overlap_s=t.step_no_overlap_s,
            scaling_efficiency=t.scaling_efficiency,
            tokens_per_s=tokens / t.step_s if t.step_s > 0 else None,
            intra_group_payload_bytes=sum(t.payload_by_op.values()),
            inter_group_payload_bytes=t.across_payload)

    def zero3_total(n):
        return memory_at("zero3", n)[3]

    recommended, reason = recommend(plans, memory, headroom, units, world, zero3_total,
                                     activations, activation_checkpointing)
    notes += _standard_notes(prec, optimizer, spec, precision_key, desc, peak_tflops)
    if "zero3" in shown and desc.source == "count" and desc.zero3_roots is None:
        notes.append("zero3 from a bare count: backward is planned to gather every unit again, "
                     "where the engine keeps the units rooted at the model itself and the "
                     "root the forward ends with; give the model (--model) for its exact bytes")
    if peak_tflops is None:
        notes.append(f"peak compute: {spec.name}, {peak:g} TFLOP/s dense "
                     f"{'fp32' if precision_key == 'fp32' else '16-bit'} (vendor figure)")
    setting = {
        "gpus_per_node": gpus, "nodes": nodes, "world_size": world,
        "gpu": _gpu_name(spec, memory, peak, precision_key),
        "gpu_memory_bytes": memory, "peak_tflops": peak, "mfu": mfu,
        "precision": precision_key, "optimizer": optimizer, "batch": batch, "seq": seq,
        "grad_accum": grad_accum, "activation_checkpointing": bool(activation_checkpointing),
        "attention": attention, "intra_node_GBps": intra, "inter_node_GBps": inter,
        "bandwidth_GBps": bandwidth, "backend": backend, "bucket_mb": bucket_mb,
        "comm_dtype": None if comm_bytes is None else str(comm_dtype).replace("torch.", ""),
        "headroom": headroom, "flops_per_step": flops, "shard_size": shard_size,
        "optimizer_state_bytes_per_param": (prec.master * desc.trainable_params
                                            + prec.state * state_elements)
        / max(desc.trainable_params, 1),
    }
    shown_plans = {n: plans[n] for n in shown}
    over_link = None if link_bps is None else link_report(
        shown_plans, plans["ddp"], desc.trainable_shapes, comm_bytes or prec.grad,
        desc.trainable_params, world, link_bps, powersgd_rank, sync_every)
    return PlanResult(model=desc.summary(), setting=setting, strategies=shown_plans,
                      recommended=recommended, reason=reason, notes=notes, units=units,
                      link=over_link)


def _gpu_name(spec, memory: int, peak: float, precision_key: str) -> str:
    """The preset's name, or where a figure was given in its place, what is left of it: a
    24 GB device planned with `--gpu h100` is not an H100."""
    kept = [what for what, given in (("compute", peak != spec.peak_tflops(precision_key)),
                                     ("memory", memory != spec.memory_bytes)) if not given]
    if len(kept) == 2:
        return spec.name
    return f"GPU with {spec.name}'s {kept[0]}" if kept else "GPU"


def _activations_and_flops(desc: ModelDesc, prec, batch, seq, grad_accum, checkpointing,
                           attention, notes):
    """Activation bytes of one micro-batch (saved tensors plus the loss's gradients at the start
    of backward, when memory peaks) and training FLOPs of one step on one device."""
    recompute = 4 / 3 if checkpointing else 1.0
    if desc.transformer is not None:
        acts = desc.transformer.activation_bytes(batch, seq, prec.activation, checkpointing,
                                                 attention)
        acts += desc.transformer.loss_transient_bytes(batch, seq)
        flops = desc.transformer.flops_per_token(seq) * batch * seq * grad_accum * recompute
        notes.append("compute is 6 x matmul weights x tokens + 12 x layers x seq x hidden per "
                     "token for attention (PaLM, Chowdhery et al. 2022, App. B)"
                     + (", x 4/3 for recomputation" if checkpointing else ""))
        return acts, flops
    fallback = 6.0 * desc.trainable_params * batch * seq * grad_accum * recompute
    if desc.module is None or desc.make_input is None:
        if desc.source == "count":
            notes.append("compute is 6 x parameters x tokens (Kaplan et al. 2020), attention "
                         "FLOPs excluded")
        return 0, fallback
    try:
        with torch.device("meta"):
            inputs = desc.make_input(batch, seq)
        traced = trace_module(desc.module, inputs, _DTYPES[prec.name])
    except Exception as exc:  # noqa: BLE001 - a forward that fails on meta: say so, go on
        first = (str(exc).strip().splitlines() or [""])[0]
        notes.append(f"activations not traced (the forward failed on the meta device: "
                     f"{type(exc).__name__}: {first[:200]}); compute is 6 x parameters x tokens")
        return 0, fallback
    if checkpointing and not traced.blocks:
        notes.append("no repeated blocks (nn.ModuleList) found: activation checkpointing is "
                     "not modelled")
    acts = traced.checkpointed_bytes if checkpointing else traced.activation_bytes
    acts += traced.loss_transient_bytes
    notes.append("compute is 3 x the forward FLOPs counted on the meta device"
                 + (" (4 x with recomputation)" if checkpointing else ""))
    return acts, 3.0 * traced.forward_flops * grad_accum * recompute


def _standard_notes(prec, optimizer, spec, precision_key, desc, peak_given):
    notes = [f"precision {prec.name}: {prec.description}",
             "total is the peak: model states and kept buffers, plus the largest of what "
             "lives at the start of backward (activations, with the loss's gradients), at its "
             "end (communication copies) and in the optimizer step (its temporaries and, "
             "under mixed precision, the fp32 gradient of the one unit being stepped); "
             "GB = 1e9 bytes, GiB = 2^30",
             "communication and step times use nominal link rates and a bandwidth-only ring "
             "model: expect real collectives to reach 70-90% of them"]
    if optimizer == "adafactor":
        notes.append("adafactor: factored second moments (row + column per matrix), no "
                     "momentum; an approximation" + (" from a stand-in transformer shape, since "
                                                      "a bare count has no shapes"
                                                      if desc.trainable_shapes is None else ""))
    if precision_key == "fp32" and peak_given is None:
        notes.append(f"fp32 compute at {spec.tflops_fp32:g} TFLOP/s (no TF32); with TF32 "
                     f"matmuls enabled give --peak-tflops")
    if precision_key in ("bf16", "bf16-mixed") and not spec.has_bf16:
        notes.append(f"{spec.name} has no bf16 tensor cores: use fp16-mixed")
    if precision_key == "bf16":
        notes.append("precision bf16 (no fp32 master) is not a px.prepare precision: phalanx "
                     "always keeps fp32 masters (bf16-mixed)")
    return notes
