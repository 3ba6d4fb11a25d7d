"""Will it fit, how fast, which strategy: memory and time of data-parallel training, per device.

Describe the model once, by count, config or factory, and the setting:

    phalanx plan --params 8e9 --gpus 8 --gpu-memory 80GB --precision fp32
    phalanx plan --config config.json --gpus 8 --nodes 4 --batch 4 --seq 4096 \
        --activation-checkpointing
    phalanx plan --model models.py:build --gpus 2 --gpu a100 --strategy zero2 --json
    phalanx plan --params 8e9 --gpus 2 --gpu rtx3090 --lora-rank 16
    phalanx plan --params 8e9 --gpus 2 --gpu rtx3090 --offload optimizer --host-memory 128GB
    phalanx plan --config llama-3.1-8b.json --gpus 2 --gpu rtx3090 --strategy zero3 \
        --precision bf16-true --optimizer adamw8bit --step-in-backward --activation-checkpointing
    phalanx plan --config llama-3.1-8b.json --gpus 2 --gpu rtx3090 --lora-rank 8 --base-dtype nf4

Memory is per device: parameters, gradients and optimizer state by ZeRO's layout (Rajbhandari
et al. 2020), activations from the transformer formula of Korthikanti et al. 2022 (configs) or a
traced forward on the meta device (factories), and the engine's buffers. Time is a ring-model
communication volume at the given link bandwidths against compute at a stated fraction of the
GPU's peak. GB = 1e9 bytes, GiB = 2^30 bytes. Fine-tuning (--lora-rank, --trainable) freezes
parameters; --offload puts the optimizer (and zero3's parameters) in host memory. When nothing
fits, the plan says what would: LoRA, or offload, with the numbers.
"""

from __future__ import annotations

import argparse

from ..spec.precisions import PLANNER_PRECISIONS
from .finetune import DEFAULT_LORA_TARGETS
from .hardware import GPUS, LINKS
from .memory import OPTIMIZERS
from .offload import DEFAULT_HOST_MEMORY_BW

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model (give exactly one)")
    model.add_argument("--params", help="parameter count: 8e9, 7.5B, 125M")
    model.add_argument("--model", metavar="PATH:FUNCTION",
                       help="a function that builds the nn.Module (models.py:build or "
                            "package.module:build); it is built on the meta device")
    model.add_argument("--config", metavar="CONFIG_JSON",
                       help="a Hugging Face style config.json (hidden size, layers, heads, "
                            "vocabulary, intermediate size)")
    model.add_argument("--input-shape", metavar="SHAPE",
                       help="with --model: per-sample input shape, e.g. 3x224x224 or seq")
    model.add_argument("--input-dtype", default="float32", choices=("float32", "long"),
                       help="dtype of the model's input (long: token ids; default float32)")
    model.add_argument("--blocks", metavar="CLASS[,CLASS]",
                       help="with --model: the repeated blocks' class names, as px.prepare's "
                            "blocks= (default: the children of the largest nn.ModuleList)")

    hw = p.add_argument_group("devices")
    hw.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    hw.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    hw.add_argument("--gpus-per-node", type=int, metavar="G",
                    help="with --nodes M: GPUs per node, and compare the flat layout with "
                         "shard_size=G (a row per layout and strategy)")
    hw.add_argument("--gpu", default="h100", help=f"preset: {', '.join(GPUS)} (default h100)")
    hw.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GB or 80GiB (default: preset)")
    hw.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s (default: preset)")
    hw.add_argument("--mfu", type=float, default=0.4,
                    help="fraction of peak compute reached (default 0.4)")
    hw.add_argument("--intra-node-bw",
                    help=f"GB/s or preset: {', '.join(LINKS)} (default: the GPU's usual link)")
    hw.add_argument("--inter-node-bw", default="ib-400g", help="GB/s or preset (default ib-400g)")
    hw.add_argument("--link", metavar="BANDWIDTH",
                    help="the bandwidth between nodes, bits or bytes, and its latency after a "
                         "+: 1Gbit, 100Mbit+20ms, 25GB/s (replaces --inter-node-bw); the plan "
                         "then says whether a step is communication-bound over it, what "
                         "PowerSGD or DiLoCo would send, and the streaming DiLoCo setting that "
                         "hides DiLoCo's exchange behind the training")
    hw.add_argument("--powersgd-rank", type=int, default=4,
                    help="with --link: the PowerSGD rank of the what-if (default 4)")
    hw.add_argument("--sync-every", type=int, default=50,
                    help="with --link: DiLoCo's steps between averages in the what-if and "
                         "the streaming setting (default 50)")

    run = p.add_argument_group("training")
    run.add_argument("--strategy", default="all",
                     help="ddp, zero1, zero2, zero3 (alias fsdp) or all (default all)")
    run.add_argument("--precision", default="bf16",
                     help=f"px.prepare's: {', '.join(PLANNER_PRECISIONS)}; bf16 and fp16 are "
                          "mixed (fp32 masters and optimizer state; bf16-mixed and fp16-mixed "
                          "name the same), bf16-true is everything in bf16 (default bf16)")
    run.add_argument("--optimizer", default="adamw",
                     help=f"{', '.join(OPTIMIZERS)}; adamw8bit and adamw4bit keep AdamW's "
                          "moments block-wise 8- and 4-bit, as torchao's AdamW8bit and "
                          "AdamW4bit (default adamw)")
    run.add_argument("--batch", type=int, default=1, help="micro-batch per device (default 1)")
    run.add_argument("--seq", type=int, help="sequence length (default 2048, or the config's "
                                             "learned positions if fewer)")
    run.add_argument("--grad-accum", type=int, default=1,
                     help="micro-steps per optimizer step (default 1)")
    run.add_argument("--activation-checkpointing", action="store_true",
                     help="count the activations of a model that recomputes its blocks")
    run.add_argument("--attention", default="eager", choices=("eager", "flash"),
                     help="attention kernel for the activation formula (default eager)")
    run.add_argument("--sliced-loss", action="store_true",
                     help="the loss is px.linear_cross_entropy's: one slice of the "
                          "vocabulary's logits at a time, not every token's (from a config)")
    run.add_argument("--bucket-mb", type=float, default=25.0,
                     help="px.prepare's bucket_mb: the cap of a unit (gradient bucket), MiB "
                          "(default 25)")
    run.add_argument("--comm-dtype", choices=("none", "bf16", "fp16"), default="none",
                     help="px.prepare's comm_dtype: the dtype gradients travel in (default "
                          "none: their own)")
    run.add_argument("--backend", default="nccl", choices=("nccl", "gloo"),
                     help="the process group's backend (its primitives and its speed; "
                          "default nccl)")
    run.add_argument("--prefetch", type=int, default=1,
                     help="zero3: blocks gathered ahead, as px.prepare's prefetch= (default 1)")
    run.add_argument("--max-gathered-mb", type=float,
                     help="zero3: bound on the parameters gathered at once, in MiB")
    run.add_argument("--keep-until-backward", action="store_true",
                     help="zero3: px.prepare's reshard_after_forward=False")
    run.add_argument("--step-in-backward", action="store_true",
                     help="px.prepare's step_in_backward=True: each unit stepped as soon as its "
                          "gradient is reduced, so zero2/zero3 hold about two units' gradient "
                          "shards (not with --offload or fp16)")
    run.add_argument("--shard-size", metavar="K",
                     help="zero1/2/3 sharded within groups of K ranks ('node': --gpus), "
                          "replicated across them; bytes within and across groups apart")

    tune = p.add_argument_group("fine-tuning and offload")
    tune.add_argument("--lora-rank", type=int, metavar="R",
                      help="freeze the model and add LoRA adapters of rank R beside the "
                           "--lora-targets projections of every block")
    tune.add_argument("--lora-targets", metavar="NAME[,NAME]",
                      help=f"with --lora-rank: the projections adapted, by module name as PEFT's "
                           f"target_modules (default {','.join(DEFAULT_LORA_TARGETS)})")
    tune.add_argument("--trainable", type=float, metavar="FRACTION",
                      help="the fraction of the parameters that learn, the rest frozen")
    tune.add_argument("--base-dtype", choices=("nf4",),
                      help="with --lora-rank or --trainable: the frozen base's nn.Linear "
                           "weights stored 4-bit (nf4: QLoRA, torchao's NF4), gathered so under "
                           "zero3 and dequantized a weight at a time")
    tune.add_argument("--offload", choices=("optimizer", "params"),
                      help="optimizer: fp32 masters and optimizer state in pinned host memory, "
                           "stepped there (zero1/zero2/zero3); params: zero3's parameter shards "
                           "there too")
    tune.add_argument("--host-memory", metavar="SIZE",
                      help="with --offload: the host's memory per node, e.g. 128GB, checked "
                           "against the pinned memory offload needs")
    tune.add_argument("--host-link", metavar="BANDWIDTH",
                      help="GB/s or preset: each GPU's link to host memory (default: the GPU "
                           "preset's PCIe link)")
    tune.add_argument("--host-memory-bw", type=float, metavar="GBPS",
                      help=f"the host's memory bandwidth per node in GB/s, for the host step "
                           f"(default {DEFAULT_HOST_MEMORY_BW:g}: two channels of DDR4-3200)")

    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--units", default="GB", choices=("GB", "GiB"),
                     help="units of the memory figures printed (default GB)")
    out.add_argument("--headroom", type=float, default=0.1,
                     help="memory kept free when recommending (default 0.1)")


def main(args: argparse.Namespace) -> int:
    from ..spec.command_error import CommandError
    from .api import plan
    from .model_desc import from_factory, input_from_shape

    given = [name for name in ("params", "model", "config") if getattr(args, name)]
    if len(given) != 1:
        raise CommandError("describe the model exactly once: --params COUNT, --config "
                           "CONFIG_JSON or --model PATH:FUNCTION"
                           + (f" (got {', '.join('--' + g for g in given)})" if given else ""))
    try:
        model = None
        if args.model:
            make_input = (input_from_shape(args.input_shape, args.input_dtype)
                          if args.input_shape else None)
            model = from_factory(args.model, make_input=make_input,
                                 blocks=args.blocks.split(",") if args.blocks else None)
        elif args.input_shape or args.blocks:
            raise ValueError(f"{'--input-shape' if args.input_shape else '--blocks'} goes with "
                             "--model")
        if args.gpus_per_node is not None:
            args.gpus = args.gpus_per_node
        result = plan(
            model=model, params=args.params, config=args.config, gpus=args.gpus,
            nodes=args.nodes, gpu=args.gpu, gpu_memory=args.gpu_memory,
            peak_tflops=args.peak_tflops, mfu=args.mfu, strategy=args.strategy,
            precision=args.precision, optimizer=args.optimizer, batch=args.batch, seq=args.seq,
            grad_accum=args.grad_accum, activation_checkpointing=args.activation_checkpointing,
            sliced_loss=args.sliced_loss, intra_node_bw=args.intra_node_bw,
            inter_node_bw=args.inter_node_bw,
            bucket_mb=args.bucket_mb, comm_dtype=args.comm_dtype, attention=args.attention,
            backend=args.backend, headroom=args.headroom, units=args.units,
            prefetch=args.prefetch, max_gathered_mb=args.max_gathered_mb,
            reshard_after_forward=not args.keep_until_backward, link=args.link,
            powersgd_rank=args.powersgd_rank, sync_every=args.sync_every,
            shard_size=args.shard_size, step_in_backward=args.step_in_backward,
            **_finetune_options(args))
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    print(result.to_json() if args.json else result)
    if args.gpus_per_node is not None and not args.json:
        from .layouts import compare_layouts
        try:
            print("\n" + str(compare_layouts(model, nodes=args.nodes, **_plan_options(args))))
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    return 0


def _plan_options(args) -> dict:
    """The plan's options given on the command line, for compare_layouts."""
    return dict(params=args.params, config=args.config, gpus_per_node=args.gpus, gpu=args.gpu,
                gpu_memory=args.gpu_memory, peak_tflops=args.peak_tflops, mfu=args.mfu,
                strategy=args.strategy, precision=args.precision, optimizer=args.optimizer,
                batch=args.batch, seq=args.seq, grad_accum=args.grad_accum,
                activation_checkpointing=args.activation_checkpointing,
                sliced_loss=args.sliced_loss, intra_node_bw=args.intra_node_bw,
                inter_node_bw=args.inter_node_bw,
                bucket_mb=args.bucket_mb, comm_dtype=args.comm_dtype, attention=args.attention,
                backend=args.backend, headroom=args.headroom, units=args.units,
                prefetch=args.prefetch, max_gathered_mb=args.max_gathered_mb,
                reshard_after_forward=not args.keep_until_backward, link=args.link,
                shard_size=args.shard_size, step_in_backward=args.step_in_backward,
                **_finetune_options(args))


def _finetune_options(args) -> dict:
    return dict(lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                trainable=args.trainable, base_dtype=args.base_dtype, offload=args.offload,
                host_memory=args.host_memory,
                host_link=args.host_link, host_memory_bw=args.host_memory_bw)
