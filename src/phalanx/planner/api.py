"""`px.plan(...)`: will it fit, how fast will it run, which strategy to use.

    import phalanx as px
    result = px.plan(params=8e9, gpus=8, gpu_memory="80GB", precision="fp32")
    print(result)                      # the table `phalanx plan` prints
    result["zero3"].total_bytes        # per-device bytes
    result.to_dict()                   # the JSON of `phalanx plan --json`

Pure arithmetic over a model description (model_desc.py): no process group, no GPU, and a
module is only ever built on the meta device. `plan` checks the options once (setting.py),
describes the model and applies the fine-tuning options (finetune.py); `plan_described` does
the arithmetic; when nothing fits, alternatives.py plans the same model with LoRA or offload.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..engine.policy import DEVICE, FULL, SHARD
from ..engine.units import step_run_bytes
from ..model.spec import Spec
from .alternatives import alternatives
from .comm import Collective, collectives, step_time
from .finetune import check_frozen, finetuned, quantized_elements
from .hybrid import across_groups
from .layout import (
    alike,
    engine_units,
    in_flight,
    lending,
    owned_elements,
    shard_elements,
    zero3_gathering,
)
from .link import link_report
from .memory import (
    NF4_BYTES,
    QUANTIZED_STATES,
    buffer_bytes,
    model_states,
    optimizer_state_elements,
    peak_bytes,
    state_bytes_of,
    step_working_bytes,
    whole_terms,
)
from .model_desc import ModelDesc, describe, input_from_shape
from .offload import device_states, host_side, offload_seconds
from .recommend import recommend
from .report import PlanResult, StrategyPlan
from .setting import Hardware, Report, Setting, Training, Workload, check_setting, groups
from .transformer import nominal_shape
from .workload import activations_and_flops, loss_bytes

__all__ = ["plan", "plan_described"]


def plan(model=None, *, params=None, config=None, blocks=None, hardware: Hardware | None = None,
         workload: Workload | None = None, training: Training | None = None,
         report: Report | None = None, spec: Spec | None = None, **options) -> PlanResult:
    """Plan data-parallel training of a model: memory per device, communication and step time
    of each strategy, and which to use. Pure arithmetic: no process group, no GPU, and a module
    is only ever built on the meta device.

        result = px.plan(params=8e9, gpus=8, gpu_memory="80GB", precision="fp32")
        print(result)                      # the table `phalanx plan` prints
        result["zero3"].total_bytes        # per-device bytes
        result.to_dict()                   # the JSON of `phalanx plan --json`

    The model is one of: `params` (a count such as 8e9 or "7.5B"), `config` (a Hugging Face style
    config dict or config.json path), or `model` (an nn.Module, a factory callable, a
    "PATH:FUNCTION" string, or any of the former). `blocks` names the repeated blocks' classes
    as px.prepare's `blocks=` does (a module or factory only).

    The options come in four frozen groups of `phalanx.planner`, each checked when it is made,
    given whole or as keywords, each keyword the field of its group by the same name and taken
    over the group given if one is (an unknown keyword is a TypeError naming it):
    `hardware=Hardware(...)`, `workload=Workload(...)`, `training=Training(...)` (or `spec=`,
    px.prepare's resolved options, `phalanx.model.spec.Spec.of(...)`: the strategy it names,
    with its options) and `report=Report(...)`.

    Hardware: `gpus` is per node; the data-parallel world is gpus x `nodes`. `gpu` is a preset
    (`gpu_memory`, `peak_tflops` in its place), `mfu` the fraction of its peak reached.
    Bandwidths are GB/s or presets ("nvlink4", "pcie5", "ib-400g", "eth-25g", ...: the list is
    `phalanx plan --help`'s); the intra-node default is the GPU preset's own link. `link`
    ("1Gbit", "100Mbit", "25GB/s", with a latency "100Mbit+20ms") is the bandwidth between
    nodes; it replaces `inter_node_bw`, and the plan says whether each strategy is
    communication-bound over it, what PowerSGD rank `powersgd_rank` or DiLoCo `sync_every`
    would send instead, and which streaming DiLoCo fragments and delay hide the exchange behind
    the inner steps at that `sync_every` (`result.link.streaming`). `backend`: "nccl" or "gloo".
    Workload: `batch` is the micro-batch per device, `seq` its sequence length, `grad_accum` the
    micro-steps per optimizer step; `activation_checkpointing`, `attention` ("eager" or
    "flash"), `sliced_loss` (the loss is px.linear_cross_entropy's: one slice of the vocabulary's
    logits at a time, not every token's; from a config), `optimizer` ("adamw8bit" and
    "adamw4bit": AdamW's moments block-wise quantized, as torchao's low-bit optimizers keep
    them); `input_shape` and `input_dtype` a factory's input
    per sample.
    Training: `strategy` ("all", or one: "ddp", "zero1", "zero2", "zero3", alias "fsdp").
    `precision` is px.prepare's: "fp32", "bf16" or "fp16" ("bf16" and "fp16" are mixed: fp32
    masters and optimizer state; "bf16-mixed" and "fp16-mixed" are the same), or "bf16-true"
    (everything in bf16, optimizer moments included, no master). `step_in_backward` is
    px.prepare's: each unit stepped as soon as its gradient is reduced (zero2/zero3 then hold
    two units' gradient shards, and the step counts beside what backward holds). `bucket_mb` and
    `comm_dtype` are px.prepare's; `prefetch`, `max_gathered_mb` and `reshard_after_forward` are
    its zero3 options, and change zero3's gathered memory and backward gathers as they change
    the engine's. `shard_size` (K, or "node": `gpus`) plans zero1/zero2/zero3 sharded within
    groups of K ranks and replicated across them, the replicas' average timed on the inter-node
    link.
    Fine-tuning: `lora_rank` freezes the model and adds LoRA adapters of that rank beside each
    `lora_targets` projection of every block (default q_proj, v_proj); `trainable` (a fraction
    in (0, 1]) plans that share of the parameters learning, the rest frozen. Frozen parameters
    are held in the compute dtype, whole under ddp/zero1/zero2 and sharded under zero3, with no
    gradient, master or optimizer state; `base_dtype="nf4"` (QLoRA, zero3) stores the frozen
    nn.Linear weights 4-bit (torchao's NF4).
    `offload`: "optimizer" keeps masters and optimizer state in pinned host memory and steps
    there (zero1/zero2/zero3; under zero2/zero3 each reduced gradient shard goes there as it is
    made); "params" also keeps zero3's parameter shards there. `host_memory` (per node, e.g.
    "128GB") is checked against it; `host_link` (GB/s or a preset; default the GPU's, PCIe) and
    `host_memory_bw` (GB/s per node, default 51.2) time the copies and the host step.
    Report: `headroom`, the share of memory kept free when recommending; `units`, "GB" or "GiB".
    When no strategy fits, the result's `alternatives` say what does: a full fine-tune in
    less memory (bf16-true, adamw8bit, the step in backward), LoRA, QLoRA, or offload.
    Raises ValueError with a one-line message for bad input.
    """
    hardware, workload, training, report = groups(
        options, hardware=hardware, workload=workload, training=training, report=report,
        spec=spec)
    make_input = input_from_shape(workload.input_shape, workload.input_dtype) \
        if workload.input_shape else None
    desc = describe(model, params=params, config=config, make_input=make_input, blocks=blocks)
    if blocks is not None and desc.module is None:
        raise ValueError("blocks names module classes: give the model as a module or a factory")
    setting = check_setting(hardware, workload, training, report)
    described = finetuned(desc, workload.lora_rank, workload.targets, workload.trainable)
    check_frozen(described, workload.base_dtype)
    result = plan_described(described, setting)
    if result.recommended is None:
        result.alternatives = alternatives(desc, setting, result, plan_described)
    return result


def _seq(desc: ModelDesc, seq: int | None) -> int:
    learned = desc.transformer.learned_positions if desc.transformer is not None else 0
    if seq is None:
        return learned if 0 < learned < 2048 else 2048
    if 0 < learned < seq:
        raise ValueError(f"seq {seq} exceeds the model's {learned} learned positions")
    return seq


def plan_described(desc: ModelDesc, s: Setting) -> PlanResult:
    """The plan of a described model (its frozen and trainable parameters already set) in a
    checked setting: memory, communication and time of every strategy, and the pick. Each
    strategy is its residency row (engine/policy.py), and everything below asks the row."""
    hw, work, train = s.hardware, s.workload, s.training
    prec, world, notes = s.precision, s.world, list(desc.notes)
    seq = _seq(desc, work.seq)
    activations, flops = activations_and_flops(desc, prec, work.batch, seq, work.grad_accum,
                                               work.activation_checkpointing, work.attention,
                                               notes, work.sliced_loss)
    compute_s = flops / (s.peak * 1e12 * hw.mfu)
    nominal = nominal_shape(desc.trainable_params) if desc.trainable_shapes is None else None
    state_elements = optimizer_state_elements(work.optimizer, desc.trainable_params,
                                              desc.trainable_shapes, nominal)
    state_bytes = state_bytes_of(work.optimizer, prec)
    align = QUANTIZED_STATES[work.optimizer][1] if work.optimizer in QUANTIZED_STATES else 1
    # a 4-bit base (memory.py's [Note: Low-bit optimizer state and a 4-bit base]): its frozen
    # Linear weights' elements, the bytes of a frozen element on average, and zero3's gathers
    # counted in compute-dtype elements that weigh as much
    w = prec.weight_bytes
    quantized, largest_quantized, why = quantized_elements(desc) \
        if work.base_dtype == "nf4" else (0, 0, None)
    notes += [why] if why else []
    frozen_bytes = (w * (desc.frozen_params - quantized) + NF4_BYTES * quantized) \
        / max(desc.frozen_params, 1)
    ratio = NF4_BYTES / w if quantized else 1.0
    weighed_params = desc.params - quantized * (1 - ratio) if quantized else desc.params
    # the step in backward: each unit stepped alone as backward reduces it ([Note: the step in
    # backward] in engine/stepping.py), while the activations, less the loss's, are held
    in_backward = train.step_in_backward
    kept_activations = max(0, activations - loss_bytes(desc, work.batch, seq, work.sliced_loss,
                                                       prec.activation_bytes)) \
        if in_backward else None
    reduce_scatter = hw.backend == "nccl"
    # the engine's units: of the trainable parameters, and under zero3 on more than one rank of
    # every parameter, frozen ones laid out with the trainable ones (layout.py)
    layouts = {zero3: engine_units(desc, zero3, prec.compute_dtype, prec.weight_bytes,
                                   train.bucket_mb) for zero3 in (False, True)}
    grouped = {zero3: alike(units) for zero3, units in layouts.items()}
    units_ = [u.trainable for u in layouts[False]] or [0]
    gathering = zero3_gathering(desc, prec.weight_bytes, train.bucket_mb,
                                **train.gathering.options(), ratio=ratio)
    # the compute-dtype copy of the 4-bit weight computing: the largest (from a count, the
    # largest unit's frozen elements)
    if largest_quantized is None:
        largest_quantized = max((u.frozen for u in layouts[True]), default=0)
    dequantized = w * min(quantized, largest_quantized)
    grad_comm = (train.comm_bytes or prec.grad_bytes) * desc.trainable_params
    # fp32 ddp steps the model's own parameters, as they are (bf16-true steps fp32 copies of
    # runs of units: memory.py)
    replicated = not prec.mixed and prec.compute_dtype is None
    run_bytes = 0 if in_backward else step_run_bytes(train.bucket_mb)

    def _owners(policy, n):
        """A matrix-wise optimizer's owners' exchange and working memory under a sharded
        optimizer (memory.py's WholeTerms), or None."""
        if policy.optimizer is not SHARD:
            return None
        return whole_terms(work.optimizer, desc.trainable_shapes, desc.trainable_params,
                           prec.master_bytes or prec.weight_bytes, n, nominal)

    @functools.lru_cache(maxsize=None)  # recommend() asks zero3 at many n, and again
    def memory_at(policy, n):
        """Model states and buffers on the device, its step temporaries and peak, and what
        offload puts on the host, of the row `policy` on n ranks."""
        laid = policy.reshards(n)  # frozen parameters laid out with the others
        units = layouts[laid]
        trained = [u for u in units if u.trained]
        sizes = [u.trainable for u in trained] or [0]
        largest_param = max((max(u.trained) for u in trained if u.known), default=max(sizes))
        shards = n if policy.optimizer is SHARD else 1
        owned_t, owned_f = owned_elements(grouped[laid], shards, align)
        owned_state = -(-state_elements * owned_t // max(desc.trainable_params, 1))
        states = model_states(policy, prec, desc.params, desc.trainable_params,
                              state_elements, n, owned=(owned_t, owned_f, owned_state),
                              state_bytes=state_bytes, frozen_bytes=frozen_bytes)
        buffers = buffer_bytes(policy, prec, desc.trainable_params, n, reduce_scatter,
                               train.comm_bytes, max(sizes), largest_param,
                               gathered_numel=gathering[0], borrowing=lending(grouped[laid], n),
                               dequantized=dequantized,
                               in_flight=in_flight(trained, n) if laid else None)
        # what the optimizer steps on a rank: fp32 ddp the model's own parameters, otherwise
        # one flat master per unit, of the unit's padded shard (ceil(unit / n) elements)
        own = policy.optimizer is FULL and replicated
        if own and desc.trainable_shapes is not None:
            stepped = [math.prod(x) for x in desc.trainable_shapes]
        else:
            stepped = [shard_elements(u, shards, align) for u in trained] or [0]
        # zero2/zero3 stepping each unit in backward, or copying each reduced shard to the host
        # as it is made: about two units' gradient shards at once (the one stepped or copied,
        # the one reduced meanwhile: consecutive units, in backward's order)
        if policy.shards_grads(n) and (in_backward or policy.masters is not DEVICE):
            pairs = [a + b for a, b in zip(stepped, stepped[1:])] or stepped
            states = dataclasses.replace(states, grads=prec.grad_bytes * max(pairs))
        host = None
        if policy.masters is DEVICE:
            step_bytes = step_working_bytes(work.optimizer, prec, stepped,
                                            foreach=hw.backend == "nccl", per_unit=not own,
                                            run_bytes=run_bytes)
            owners = _owners(policy, n)
            step_bytes += owners.working if owners is not None else 0
        else:
            step_bytes = 0  # the step runs on the host
            host = host_side(policy, prec, stepped, owned_state, owned_f,
                             {"forward": owned_t + (owned_f * frozen_bytes / w if quantized
                                                    else owned_f),
                              "backward": -(-(weighed_params - gathering[1]) // n)},
                             run_bytes, state_bytes=state_bytes, frozen_bytes=frozen_bytes,
                             grads_on_host=policy.shards_grads(n))
            states = device_states(states, policy, n,
                                   math.ceil(w * owned_t + frozen_bytes * owned_f))
        return (states, buffers, step_bytes, host) + peak_bytes(
            states.total, buffers, activations, step_bytes, kept_activations)

    tokens = world * work.batch * seq * work.grad_accum
    headroom = s.report.headroom
    host_limit = None if hw.host_bytes is None else (1 - headroom) * hw.host_bytes
    plans = {}
    for row in s.rows:
        n = s.shard_size if s.shard_size is not None and row.optimizer is SHARD else world
        states, buffers, step_bytes, host, total, phase = memory_at(row, n)
        gathers = row.params is SHARD  # every parameter, gathered; of them, some kept
        gathered = math.ceil(w * (weighed_params if gathers else desc.trainable_params))
        kept = math.ceil(w * gathering[1]) if gathers else 0
        colls = collectives(row, grad_comm, gathered, n, reduce_scatter, kept)
        owners = _owners(row, n)
        if owners is not None:  # a matrix-wise optimizer: engine/owners.py
            colls.append(Collective("all_to_all", owners.payload, "after_step"))
        within = hw.intra if n < world and hw.gpus % n == 0 else hw.bandwidth  # a group in a node
        uploads = None if host is None else {
            phase_: b / (hw.host_gbps * 1e9) for phase_, b in host.gather_up_bytes.items()}
        t = step_time(colls, n, compute_s, work.grad_accum, within,
                      work.activation_checkpointing, units=len(units_),
                      across=across_groups(row, grad_comm, s.shard_size),
                      replicas=world // n, across_gbps=hw.inter if hw.nodes > 1 else hw.intra,
                      host_phase_s=uploads)
        step_s, no_overlap_s, extra = t.step_s, t.step_no_overlap_s, {}
        if host is not None:
            off = offload_seconds(host, hw.gpus, hw.host_gbps, hw.host_memory_gbps,
                                  work.grad_accum)
            step_s, no_overlap_s = step_s + off.exposed_s, no_overlap_s + off.serial_s
            per_node = hw.gpus * host.bytes_per_rank
            extra = dict(host_bytes=host.bytes_per_rank, host_bytes_per_node=per_node,
                         fits_host=None if hw.host_bytes is None else per_node <= hw.host_bytes,
                         host_transfer_bytes=off.transfer_bytes,
                         host_transfer_s=off.transfer_s, host_step_s=off.host_step_s)
        host_ok = host is None or host_limit is None or hw.gpus * host.bytes_per_rank <= host_limit
        plans[row.name] = StrategyPlan(
            strategy=row.name, params_bytes=states.params, grads_bytes=states.grads,
            optimizer_bytes=states.optimizer, activations_bytes=activations,
            buffers_bytes=sum(buffers.values()), buffers_detail=buffers,
            step_working_bytes=step_bytes, total_bytes=total, peak_at=phase,
            fits=total <= hw.memory and extra.get("fits_host") is not False,
            fits_with_headroom=total <= (1 - headroom) * hw.memory and host_ok,
            comm_bytes_per_step=t.comm_bytes, comm_payload_bytes=t.payload_by_op,
            comm_time_s=t.comm_s, compute_time_s=t.compute_s, step_time_s=step_s,
            step_time_no_overlap_s=no_overlap_s,
            scaling_efficiency=compute_s / step_s if step_s > 0 else 1.0,
            tokens_per_s=tokens / step_s if step_s > 0 else None,
            intra_group_payload_bytes=sum(t.payload_by_op.values()),
            inter_group_payload_bytes=t.across_payload, **extra)

    resharding = next(row for row in s.rows if row.params is SHARD)

    def zero3_total(n):
        return memory_at(resharding, n)[4]

    candidates = {row.name: plans[row.name] for row in s.candidates}
    recommended, reason = recommend(candidates, hw.memory, headroom, s.report.units, world,
                                    zero3_total, activations, work.activation_checkpointing,
                                    host_memory=hw.host_bytes, gpus_per_node=hw.gpus,
                                    per_param=None if train.offload else _per_param(
                                        prec, work.optimizer, state_elements, desc,
                                        frozen_bytes, in_backward))
    notes += _standard_notes(desc, s)
    setting = _setting_dict(desc, s, seq, flops, state_elements)
    shown = {row.name: plans[row.name] for row in s.shown}
    over_link = None if hw.link_bps is None else link_report(
        shown, plans["ddp"], desc.trainable_shapes, train.comm_bytes or prec.grad_bytes,
        desc.trainable_params, world, hw.link_bps, train.powersgd_rank, train.sync_every,
        hw.link_latency_s, prec.master_bytes or prec.weight_bytes)
    return PlanResult(model=desc.summary(), setting=setting, strategies=shown,
                      recommended=recommended, reason=reason, notes=notes, units=s.report.units,
                      link=over_link)


def _per_param(prec, optimizer, state_elements, desc, frozen_bytes=None,
               in_backward=False) -> str:
    """Why model states cost what they do, for a plan that does not fit."""
    k = (prec.master_bytes * desc.trainable_params
         + state_bytes_of(optimizer, prec) * state_elements) / max(desc.trainable_params, 1)
    line = (f"{prec.weight_bytes} + {prec.grad_bytes} + {k:g} bytes of weights, gradients "
            f"and optimizer state per trainable parameter ({prec.name}, {optimizer})")
    if desc.frozen_params:
        fb = prec.weight_bytes if frozen_bytes is None else frozen_bytes
        line += f", {fb:.3g} per frozen one"
    if in_backward:
        line += "; stepped in backward, zero2 and zero3 keep two units' gradient shards"
    return line


def _gpu_name(s: Setting) -> str:
    """The preset's name, or where a figure was given in its place, what is left of it: a
    24 GB device planned with `--gpu h100` is not an H100."""
    preset = s.hardware.preset
    kept = [what for what, given in (("compute", s.peak != preset.peak_tflops(s.precision)),
                                     ("memory", s.hardware.memory != preset.memory_bytes))
            if not given]
    if len(kept) == 2:
        return preset.name
    return f"GPU with {preset.name}'s {kept[0]}" if kept else "GPU"


def _setting_dict(desc, s: Setting, seq, flops, state_elements) -> dict:
    prec, hw, work, train = s.precision, s.hardware, s.workload, s.training
    return {
        "gpus_per_node": hw.gpus, "nodes": hw.nodes, "world_size": s.world,
        "gpu": _gpu_name(s), "gpu_memory_bytes": hw.memory, "peak_tflops": s.peak,
        "mfu": hw.mfu, "precision": prec.name, "optimizer": work.optimizer,
        "batch": work.batch, "seq": seq, "grad_accum": work.grad_accum,
        "activation_checkpointing": work.activation_checkpointing,
        "sliced_loss": work.sliced_loss,
        "attention": work.attention, "intra_node_GBps": hw.intra, "inter_node_GBps": hw.inter,
        "bandwidth_GBps": hw.bandwidth, "backend": hw.backend, "bucket_mb": train.bucket_mb,
        "comm_dtype": None if train.comm_bytes is None
        else str(train.comm_dtype).replace("torch.", ""),
        "headroom": s.report.headroom, "flops_per_step": flops, "shard_size": s.shard_size,
        "optimizer_state_bytes_per_param": (prec.master_bytes * desc.trainable_params
                                            + state_bytes_of(work.optimizer, prec)
                                            * state_elements)
        / max(desc.trainable_params, 1),
        "step_in_backward": train.step_in_backward, "base_dtype": work.base_dtype,
        "offload": train.offload, "host_memory_bytes": hw.host_bytes,
        "host_link_GBps": hw.host_gbps, "host_memory_GBps": hw.host_memory_gbps,
    }


def _standard_notes(desc, s: Setting) -> list[str]:
    prec, hw, preset, offload = s.precision, s.hardware, s.hardware.preset, s.training.offload
    fp32 = prec.compute_dtype is None  # the parameters' own dtype, planned as fp32
    notes = [f"precision {prec.name}: {prec.description}",
             "total is the peak: model states and kept buffers, plus the largest of what "
             "lives at the start of backward (activations, with the loss's gradients), at its "
             "end (communication copies) and in the optimizer step (its temporaries and, "
             "under mixed precision, the fp32 gradient of the one unit being stepped); "
             "GB = 1e9 bytes, GiB = 2^30",
             *(["step_in_backward: each unit is stepped alone as soon as its gradient is "
                "reduced, so zero2/zero3 hold about two units' gradient shards, and the step's "
                "working memory (one unit's) is counted beside what backward holds, the loss's "
                "memory freed"] if s.training.step_in_backward else []),
             *(["nf4 base: frozen nn.Linear weights 4-bit (0.5 + 1/64 + 4/16384 bytes per "
                "element, torchao's NF4), gathered as such under zero3; a weight dequantized "
                "while it computes"] if s.workload.base_dtype == "nf4" else []),
             "communication and step times use nominal link rates and a bandwidth-only ring "
             "model: expect real collectives to reach 70-90% of them"]
    if s.workload.optimizer == "adafactor":
        notes.append("adafactor: factored second moments (row + column per matrix), no "
                     "momentum; an approximation" + (" from a stand-in transformer shape, since "
                                                      "a bare count has no shapes"
                                                      if desc.trainable_shapes is None else ""))
    if fp32 and not hw.peak_given:
        notes.append(f"fp32 compute at {preset.tflops_fp32:g} TFLOP/s (no TF32); with TF32 "
                     f"matmuls enabled give --peak-tflops")
    if prec.compute_dtype == torch.bfloat16 and not preset.has_bf16:
        notes.append(f"{preset.name} has no bf16 tensor cores: use fp16")
    if any(row.params is SHARD for row in s.shown) and desc.source == "count" \
            and desc.zero3_roots is None:
        notes.append("zero3 from a bare count: backward is planned to gather every unit again, "
                     "where the engine keeps the units rooted at the model itself and the "
                     "root the forward ends with; give the model (--model) for its exact bytes")
    if offload is not None:
        notes.append(f"offload={offload!r}: a model of the host side (planner/offload.py): "
                     f"pinned host memory per node for {hw.gpus} ranks, copies over "
                     f"{hw.host_gbps:g} GB/s of host link per GPU, the host step at "
                     f"{hw.host_memory_gbps:g} GB/s of host memory shared by the node"
                     + ("" if hw.host_bytes is not None
                        else "; host memory not checked: give --host-memory"))
    if not hw.peak_given:
        notes.append(f"peak compute: {preset.name}, {s.peak:g} TFLOP/s dense "
                     f"{'fp32' if fp32 else '16-bit'} (vendor figure)")
    return notes
