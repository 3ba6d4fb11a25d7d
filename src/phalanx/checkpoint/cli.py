"""`phalanx export CKPT OUT.safetensors`: a checkpoint's full weights as one safetensors file.

Offline: no process group, any machine that can read the checkpoint. Every file of the
checkpoint is checked against its size and checksum first. The output holds the model's tensors
under the original module's names (fp32 masters of trained parameters, buffers and frozen
parameters in their own dtype; a tied weight under each of its names), so

    model.load_state_dict(safetensors.torch.load_file("OUT.safetensors"))

restores the plain model. `--dtype bfloat16` casts the floating tensors; `--max-shard-size 5GB`
writes Hugging Face's sharded layout into the directory OUT instead (as `px.export` does with
`dtype=` and `max_shard_size=`). Tensors are read and written one at a time.

For a LoRA model, `--adapter` writes its adapter alone into the directory OUT as PEFT saves it
(`adapter_model.safetensors` under PEFT's keys; no adapter_config.json, which a checkpoint
does not hold: take the one PEFT wrote, or export from the running model with
`px.export(OUT, model, adapter=True)`). `--merge-lora` is refused: a checkpoint does not record
the LoRA scaling (lora_alpha / r) that merging needs; export the merged model from the running
model with `px.export(OUT, model, merge_lora=True)`.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["add_arguments", "main"]

DTYPES = ("float32", "bfloat16", "float16", "float64")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory (px.save)")
    parser.add_argument("out", metavar="OUT", help="the safetensors file to write (a directory "
                        "with --max-shard-size or --adapter)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="cast the floating tensors to this dtype (default: as saved)")
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="write Hugging Face's sharded layout into the directory OUT, files "
                             "of at most SIZE (e.g. 5GB, 500MB)")
    parser.add_argument("--adapter", nargs="?", const=True, default=False, metavar="NAME",
                        help="write only the LoRA adapter (NAME, if the model holds several) "
                             "into the directory OUT, as PEFT saves it")
    parser.add_argument("--merge-lora", action="store_true",
                        help="refused: a checkpoint does not record the LoRA scaling; merge "
                             "with px.export(OUT, model, merge_lora=True) from the running model")


def main(args: argparse.Namespace) -> int:
    import torch

    from phalanx.spec.command_error import CommandError

    from .api import export_checkpoint
    from .lora import ADAPTER_FILE
    from .reader import CheckpointError

    dtype = getattr(torch, args.dtype) if getattr(args, "dtype", None) else None
    try:
        export_checkpoint(args.checkpoint, args.out, dtype=dtype,
                          max_shard_size=_size(getattr(args, "max_shard_size", None)),
                          merge_lora=getattr(args, "merge_lora", False),
                          adapter=getattr(args, "adapter", False))
    except (CheckpointError, ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    if getattr(args, "adapter", False):
        print(f"wrote {os.path.join(args.out, ADAPTER_FILE)} (no adapter_config.json: a "
              "checkpoint holds no LoRA configuration)")
    else:
        print(f"wrote {args.out}")
    return 0


def _size(text: str | None):
    """--max-shard-size as px.export takes it: a size with its unit ("5GB"), or digits alone,
    a number of bytes."""
    return int(text) if text is not None and text.isdigit() else text
