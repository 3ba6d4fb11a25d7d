"""`phalanx checkpoint info CKPT`: what a checkpoint holds, and whether its files are intact.

Prints the step, world size, strategy and precision it was saved with, when, its files with
their sizes, every model tensor with its shape and dtype, the optimizer state's names, and the
result of checking every file against the size and CRC-32 in the manifest. Exit status 1 when a
file is missing or altered, 2 when CKPT is not a checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import os

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["info"], help="what to do (info: describe and verify)")
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory (px.save)")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def main(args: argparse.Namespace) -> int:
    from phalanx.spec.command_error import CommandError

    from .common import MODEL, OPTIM, optim_parts, under
    from .reader import CheckpointError, read_manifest, verify_files

    path = os.path.abspath(args.checkpoint)
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        raise CommandError(str(exc)) from None
    saved = datetime.datetime.fromtimestamp(manifest.get("saved_at", 0), datetime.timezone.utc)
    print(f"checkpoint {path}")
    print(f"  saved {saved:%Y-%m-%d %H:%M:%S} UTC at step {manifest.get('step')}, "
          f"{manifest['world_size']} rank(s), strategy {manifest.get('strategy')}, "
          f"precision {manifest.get('precision')}")
    files = manifest["files"]
    print(f"  files ({_size(sum(f['bytes'] for f in files.values()))}):")
    for name in sorted(files):
        print(f"    {name:28s} {_size(files[name]['bytes']):>12s}  "
              f"crc32 {files[name]['crc32']:08x}")
    model = under(MODEL, manifest["tensors"])
    optim = sorted({optim_parts(k)[1] for k in manifest["tensors"] if k.startswith(OPTIM)})
    numel = 0
    print(f"  model tensors ({len(model)}):")
    for name, info in model.items():
        n = 1
        for d in info["shape"]:
            n *= d
        numel += n
        print(f"    {name:40s} {str(tuple(info['shape'])):>18s} {info['dtype']}")
    for alias, name in manifest.get("aliases", {}).items():
        print(f"    {alias:40s} (the same tensor as {name})")
    print(f"  {numel:,} model elements; optimizer state: {', '.join(optim) or 'none'}")
    problems = verify_files(path, manifest, sorted(files))
    if problems:
        print("  integrity: FAILED")
        for problem in problems:
            print(f"    {problem}")
        return 1
    print("  integrity: every file matches its size and CRC-32")
    return 0
