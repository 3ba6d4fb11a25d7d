"""`phalanx export CKPT OUT.safetensors`: a checkpoint's full weights as one safetensors file.

Offline: no process group, any machine that can read the checkpoint. Every file of the
checkpoint is checked against its size and checksum first. The output holds the model's tensors
under the original module's names (fp32 masters of trained parameters, buffers and frozen
parameters in their own dtype; a tied weight under each of its names), so

    model.load_state_dict(safetensors.torch.load_file("OUT.safetensors"))

restores the plain model.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory (px.save)")
    parser.add_argument("out", metavar="OUT", help="the safetensors file to write")


def main(args: argparse.Namespace) -> int:
    from phalanx.spec.command_error import CommandError

    from .api import export_checkpoint
    from .reader import CheckpointError

    try:
        export_checkpoint(args.checkpoint, args.out)
    except CheckpointError as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    print(f"wrote {args.out}")
    return 0
