"""The `phalanx` command: one sub-command a module.

Each sub-command's module provides `add_arguments(parser)` and `main(args) -> int`; this file
only wires them together, so a reader finds each command's flags beside its code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .spec.command_error import CommandError

# name -> (module, one-line help)
COMMANDS = {
    "run": ("phalanx.launch.cli", "start N workers per node through PyTorch's elastic agent"),
    "plan": ("phalanx.planner.cli",
             "memory and time planner: will it fit, how fast, which strategy"),
    "export": ("phalanx.checkpoint.cli",
               "a checkpoint's weights (or its LoRA adapter) as safetensors"),
    "checkpoint": ("phalanx.checkpoint.info_cli", "describe a checkpoint and verify its files"),
    "report": ("phalanx.observe.report_cli",
               "plots and a summary of a run directory's step reports"),
    "demo": ("phalanx.demo", "train a small model on embedded data (the README's first command)"),
}




def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx",
        description="phalanx: data-parallel training for PyTorch (DDP, ZeRO-1, ZeRO-2 and ZeRO-3).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._module.main(args) or 0)
    except CommandError as exc:
        print(f"phalanx {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
