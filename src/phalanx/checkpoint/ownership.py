"""Which checkpoints, and which leftovers of saves, are this job's: the only ones it removes.

[Note: a job removes only what it wrote]
Two jobs may save into one parent directory (job a writes a000, a001, ..., job b writes b000,
...). `keep_last` once removed every older checkpoint there and every leftover of an abandoned
save, and so deleted job b's save in progress (`b000.partial-*`), which then failed. Now each
job has an id (12 hex digits): rank 0 makes one at its first save and every rank takes rank
0's. It is written into the manifest of each checkpoint the job completes ("job") and into the
name of each directory its saves write under (`<name>.partial-<job>-<token>`, and
`<name>.old-<job>-<token>` for a checkpoint being replaced), and `keep_last`, like the removal
of abandoned saves, touches only entries of this job (removal.py).

A job restarted after a failure is a new set of processes but the same training, resumed
from its newest checkpoint. So `px.load` adopts the id of the job that wrote the checkpoint
and that job's own earlier ids (the manifest's "lineage", which every checkpoint carries on):
from then on what those wrote counts as this job's, and what a save killed before the restart
left is removed after it. (A job that starts from a checkpoint lying in the directory it saves
into adopts its writer the same way, so `keep_last` may remove that checkpoint once the job
has k newer ones.) Checkpoints and leftovers with no job in them, written by an earlier
version of phalanx, are never removed.
"""

from __future__ import annotations

import os
import re
import uuid

from .reader import CheckpointError, complete_checkpoints, read_manifest

__all__ = ["job_ids", "agree_on_job", "adopt", "manifest_fields", "job_of_leftover",
           "checkpoints_of", "LEFTOVER"]

# `<name>.partial-<job>-<token>` or `<name>.old-<job>-<token>`; group 2 is the job
LEFTOVER = re.compile(r"\.(partial|old)-([0-9a-f]{12})-[0-9a-f]{12}$")

_state: dict = {"pid": None, "own": None, "lineage": set()}


def _mine() -> dict:
    """This process's state; a forked child starts its own (it is another job's process)."""
    if _state["pid"] != os.getpid():
        _state.update(pid=os.getpid(), own=None, lineage=set())
    return _state


def job_ids() -> list[str]:
    """This job's id, made here if there is none yet, then the ids it adopted."""
    state = _mine()
    if state["own"] is None:
        state["own"] = uuid.uuid4().hex[:12]
    return [state["own"], *sorted(state["lineage"] - {state["own"]})]


def agree_on_job(every_ranks_ids: list[list[str]]) -> list[str]:
    """At a save, given each rank's `job_ids()`: rank 0's id becomes every rank's, and what
    any rank adopted (or was before, as a replacement) is the job's lineage. Returns the
    job's ids, its own first."""
    state = _mine()
    state["own"] = every_ranks_ids[0][0]
    state["lineage"] |= {i for ids in every_ranks_ids for i in ids}
    return job_ids()


def adopt(manifest: dict) -> None:
    """A checkpoint was loaded: its writer and the writer's lineage are this job's from now."""
    job = manifest.get("job")
    if isinstance(job, str):
        _mine()["lineage"] |= {job, *manifest.get("lineage", [])}


def manifest_fields(ids: list[str]) -> dict:
    """What a manifest records of the job that writes it."""
    return {"job": ids[0], "lineage": ids[1:]}


def job_of_leftover(name: str) -> str | None:
    """The job in a save's directory name (`.partial-` or `.old-`), or None."""
    found = LEFTOVER.search(name)
    return found.group(2) if found else None


def checkpoints_of(parent: str, jobs: list[str]) -> list[str]:
    """The complete checkpoints in `parent` that the jobs `jobs` wrote, oldest first."""
    out = []
    for _, where in complete_checkpoints(parent):
        try:
            if read_manifest(where).get("job") in jobs:
                out.append(where)
        except CheckpointError:  # removed meanwhile
            pass
    return out
