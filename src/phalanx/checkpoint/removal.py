"""What a save may replace or remove: a phalanx checkpoint, or what a save of one left behind,
and nothing else.

[Note: a save removes only checkpoints]
`px.save(path)` puts a checkpoint at `path`, replacing what stood there, and with `keep_last`
removes older checkpoints beside it and what abandoned saves left. A path that is mistyped, or
`px.save(".")`, must never cost the user a directory of their own. So each removal is checked
first, and the save refuses, on every rank and before anything is written, what it may not
replace:

- `path` may be absent, an empty directory, or a complete phalanx checkpoint holding nothing
  but its own files (its manifest, the files the manifest lists, and a save's leftovers);
  a regular file, or a directory holding anything else, is refused with its name;
- `keep_last` removes only this job's checkpoints and leftovers (see [Note: a job removes only
  what it wrote] in ownership.py), and a complete checkpoint only if it holds nothing but its
  own files (one the user added a note to is left, with a warning);
- an abandoned save is `<name>.partial-<job>-<token>` or `<name>.old-<job>-<token>` (12 hex
  digits each) beside the checkpoint, holding only files a save writes; anything else of that
  shape is left alone;
- `px.export` replaces a safetensors file (an earlier export), never a directory or another
  kind of file.
The check is made again by rank 0 just before the rename, since the directory may have changed
while the ranks wrote (a background save).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import warnings

from .ownership import checkpoints_of, job_of_leftover
from .reader import FORMAT, MANIFEST

__all__ = ["why_not_replaceable", "holds_only_its_own_files", "abandoned", "remove_older",
           "why_not_export_target"]

_SAVE_FILES = re.compile(r"^(rank\d{5}\.safetensors|state\.pt|manifest\.json)$")


def _listing(path: str) -> list[str]:
    """Every file and directory under `path`, relative to it (directories end with '/')."""
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        prefix = "" if rel == "." else rel + "/"
        out += [prefix + d + "/" for d in dirnames] + [prefix + f for f in filenames]
    return sorted(out)


def _manifest(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def _foreign(path: str, manifest: dict) -> list[str]:
    """What a checkpoint directory holds beyond its own files."""
    own = {MANIFEST, *manifest.get("files", {})}
    return [entry for entry in _listing(path) if entry not in own]


def holds_only_its_own_files(path: str) -> bool:
    """A complete phalanx checkpoint, with nothing in it that a save did not write."""
    manifest = _manifest(path)
    return manifest is not None and not _foreign(path, manifest)


def _shown(entries: list[str]) -> str:
    return ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")


def why_not_replaceable(path: str) -> str | None:
    """None when `px.save` may put a checkpoint at `path`; else why not, for the error."""
    if not os.path.lexists(path):
        return None
    if os.path.islink(path) or not os.path.isdir(path):
        return (f"{path} is a file, not a phalanx checkpoint; px.save replaces only a "
                "checkpoint. Give the checkpoint a path of its own (a new directory name)")
    entries = _listing(path)
    if not entries:
        return None
    manifest = _manifest(path)
    if manifest is None:
        return (f"{path} is a directory that is not a phalanx checkpoint (it holds "
                f"{_shown(entries)}); px.save replaces only a checkpoint. Give the checkpoint a "
                "path of its own, such as a new directory inside this one")
    foreign = _foreign(path, manifest)
    if foreign:
        return (f"{path} is a phalanx checkpoint that also holds files it did not save "
                f"({_shown(foreign)}); px.save would remove them with the old checkpoint. Move "
                "them out, or save to another path")
    return None


def abandoned(parent: str, jobs: list[str]) -> list[str]:
    """The entries of `parent` that saves of the jobs `jobs` left (see the Note)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    out = []
    for name in names:
        where = os.path.join(parent, name)
        if job_of_leftover(name) not in jobs or os.path.islink(where) or \
                not os.path.isdir(where):
            continue
        if all(_SAVE_FILES.match(entry) for entry in _listing(where)):
            out.append(where)
    return out


def remove_older(parent: str, newest: str, keep_last: int, jobs: list[str]) -> None:
    """After `newest` is complete: keep the `keep_last` newest checkpoints the jobs `jobs`
    wrote in `parent` and remove their older ones, then what their abandoned saves left
    there (a rank killed midway leaves `<path>.partial-<job>-<token>`). Only leftovers older
    than `newest` are touched, and only those that hold nothing but a save's files."""
    for older in checkpoints_of(parent, jobs)[:-keep_last]:
        if older == newest:
            continue
        if holds_only_its_own_files(older):
            shutil.rmtree(older, ignore_errors=True)
        else:
            warnings.warn(f"px.save(keep_last={keep_last}) kept {older}: it holds files that "
                          "no save wrote", stacklevel=3)
    cutoff = os.path.getmtime(os.path.join(newest, MANIFEST))
    for where in abandoned(parent, jobs):
        try:
            if os.path.getmtime(where) < cutoff:
                shutil.rmtree(where, ignore_errors=True)
        except OSError:
            pass


def why_not_export_target(path: str) -> str | None:
    """None when `px.export` may write `path`: absent, or an earlier safetensors file."""
    if not os.path.lexists(path):
        return None
    if os.path.isdir(path):
        return f"{path} is a directory; px.export writes one .safetensors file: name the file"
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 2**27:  # a header of over 128 MiB: not a safetensors file
                raise ValueError
            json.loads(f.read(n))
        return None
    except (OSError, ValueError, struct.error):
        return (f"{path} exists and is not a safetensors file; px.export replaces only an "
                "earlier export. Choose another file name")
