"""Two jobs saving into one parent directory, each with keep_last: a job removes only what it
wrote (see [Note: a job removes only what it wrote] in checkpoint/ownership.py).

Job b (a process of its own, 2 ranks) completes b000, then stops in the middle of writing
b001 (its rank 0 waits, after writing its file, for the test to let it go); job a (2 ranks)
saves a000..a002 with keep_last=1 meanwhile; then job b completes b001. Before, job a's
cleanup removed b000 and the files of b001 being written, and job b failed with a bare
FileNotFoundError.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

import phalanx as px
from phalanx.testing import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def _model():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return px.prepare(model, opt, strategy="zero2")


def _job_a(root):
    model, opt = _model()
    for step in range(3):
        px.save(os.path.join(root, f"a{step:03d}"), model=model, optimizer=opt, keep_last=1)
    return sorted(os.listdir(root))


def _job_b(root, writing, go):
    """b000, then b001 held after rank 0 wrote its file until the file `go` exists."""
    import phalanx.checkpoint.saving as saving

    model, opt = _model()
    px.save(os.path.join(root, "b000"), model=model, optimizer=opt, keep_last=1)
    if px.rank() == 0:
        write = saving.write_tensors

        def write_then_wait(*args):
            info = write(*args)
            open(writing, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(go):  # an event: the test creates `go`
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never let job b go on")
                time.sleep(0.02)
            return info

        saving.write_tensors = write_then_wait
    px.save(os.path.join(root, "b001"), model=model, optimizer=opt, keep_last=1)
    return True


def test_a_job_removes_only_what_it_wrote(tmp_path):
    root, writing, go = (str(tmp_path / name) for name in ("ckpts", "b-writing", "go"))
    os.makedirs(root)
    code = (f"import sys; sys.path.insert(0, {HERE!r}); from phalanx.testing import run_ranks; "
            f"from test_checkpoint_jobs import _job_b; "
            f"run_ranks(_job_b, 2, args=({root!r}, {writing!r}, {go!r}), timeout=180)")
    job_b = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not os.path.exists(writing):  # job b is writing b001
            assert job_b.poll() is None, job_b.communicate()[0]
            assert time.monotonic() < deadline, "job b never began writing b001"
            time.sleep(0.02)
        during = run_ranks(_job_a, 2, args=(root,), timeout=120)[0]
        assert [e for e in during if not e.startswith("b001.partial-")] == ["a002", "b000"]
        assert len(during) == 3, during  # b001 being written, untouched
        open(go, "w").close()
        out, _ = job_b.communicate(timeout=180)
    finally:
        job_b.kill()
    assert job_b.returncode == 0, out
    assert sorted(os.listdir(root)) == ["a002", "b001"]  # b's keep_last: its own b000 only
    for name in ("a002", "b001"):
        model = nn.Linear(4, 3).double()
        px.load(os.path.join(root, name), model=model)


@pytest.mark.one_process
def test_a_save_whose_directory_another_process_removed_says_so(tmp_path, monkeypatch):
    import phalanx.checkpoint.saving as saving

    write = saving.write_tensors

    def write_then_lose_it(path, tensors):  # another process removes what this save writes
        info = write(path, tensors)
        shutil.rmtree(os.path.dirname(path))
        return info

    monkeypatch.setattr(saving, "write_tensors", write_then_lose_it)
    with pytest.raises(px.CheckpointError, match=r"rank00000\.safetensors, which its rank wrote, "
                       r"is gone .* was removed or emptied while the ranks wrote it: by another "
                       r"process, not by this job; nothing of this save was kept"):
        px.save(tmp_path / "c", model=nn.Linear(4, 3))
    assert os.listdir(tmp_path) == []


@pytest.mark.one_process
def test_a_reload_falls_back_only_on_this_jobs_older_checkpoints(tmp_path):
    """`fallbacks(newest)`: where continue mode's reload goes back to while a checkpoint does
    not verify: this job's, newest first, never another job's in the same directory."""
    import json

    from phalanx.checkpoint.api import fallbacks

    model = nn.Linear(4, 3)
    for name in ("s0", "b0", "s1", "s2", "s3"):
        px.save(tmp_path / name, model=model)
    manifest = tmp_path / "b0" / "manifest.json"
    other = dict(json.loads(manifest.read_text()), job="ba9876543210")  # another job's
    manifest.write_text(json.dumps(other))
    assert fallbacks(tmp_path / "s2") == [str(tmp_path / n) for n in ("s2", "s1", "s0")]
