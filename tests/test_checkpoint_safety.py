"""px.save, keep_last and px.export remove only what a save made (see [Note: a save removes
only checkpoints] in checkpoint/removal.py), on real ranks.

Each case puts something of the user's where a save would go, saves from 2 ranks, and checks
that every rank got the error and that every file of the user's is still there, unchanged.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import run_ranks

TOKEN = "0123456789ab"  # the shape of a save's token: 12 hexadecimal digits


def _prepared(strategy="zero2"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy=strategy)
    x = torch.randn(4, 6, dtype=torch.float64)
    F.mse_loss(model(x), torch.zeros(4, 2, dtype=torch.float64)).backward()
    opt.step()
    return model, opt


def _tree(root) -> dict[str, bytes]:
    """Every file under `root` (or `root` itself, a file) and its contents."""
    if os.path.isfile(root):
        return {"": open(root, "rb").read()}
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def _user_project(where):
    os.makedirs(os.path.join(where, "src"))
    with open(os.path.join(where, "src", "main.py"), "w") as f:
        f.write("print('hello')\n")
    with open(os.path.join(where, "README.md"), "w") as f:
        f.write("# my project\n")


def _save_to(path, background=False):
    model, opt = _prepared()
    try:
        px.save(path, model=model, optimizer=opt, background=background)
        if background:
            from phalanx.checkpoint import wait_for_saves
            wait_for_saves()
    except px.CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("what", ["project", "file", "checkpoint-with-notes"])
@pytest.mark.parametrize("background", [False, True])
def test_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path, what, background):
    target = str(tmp_path / "target")
    if what == "project":
        _user_project(target)
    elif what == "file":
        with open(target, "w") as f:
            f.write("my notes\n")
    else:  # a real checkpoint, then a file of the user's put inside it
        assert run_ranks(_save_to, 2, args=(target,)) == [None, None]
        with open(os.path.join(target, "notes.txt"), "w") as f:
            f.write("best run so far\n")
    before = _tree(target)
    errors = run_ranks(_save_to, 2, args=(target, background))
    assert all(e is not None and "refused" in e for e in errors), errors
    assert "is a file" in errors[0] if what == "file" else \
        ("holds src/, src/main.py" in errors[0] or "README.md" in errors[0]
         if what == "project" else "notes.txt" in errors[0]), errors[0]
    assert _tree(target) == before  # nothing of the user's touched
    assert sorted(os.listdir(tmp_path)) == ["target"]  # and no partial save left beside it


def _save_in_cwd(where):
    os.chdir(where)
    return _save_to(".")


def test_saving_to_the_working_directory_is_refused(tmp_path):
    _user_project(str(tmp_path))
    before = _tree(str(tmp_path))
    errors = run_ranks(_save_in_cwd, 2, args=(str(tmp_path),))
    assert all(e and "is a directory that is not a phalanx checkpoint" in e for e in errors)
    assert _tree(str(tmp_path)) == before


@pytest.mark.parametrize("existing", ["absent", "empty", "checkpoint"])
def test_save_replaces_a_checkpoint_or_an_empty_directory(tmp_path, existing):
    target = str(tmp_path / "ckpt")
    if existing == "empty":
        os.makedirs(target)
    elif existing == "checkpoint":
        assert run_ranks(_save_to, 2, args=(target,)) == [None, None]
    assert run_ranks(_save_to, 2, args=(target,)) == [None, None]
    assert px.latest_checkpoint(str(tmp_path)) == target
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _keep_last(root, steps):
    """Save `steps` with keep_last=1, resuming first (as a restarted job does) when `root`
    holds a checkpoint: what the job before wrote is then this job's too."""
    model, opt = _prepared()
    latest = px.latest_checkpoint(root)
    if latest is not None:
        px.load(latest, model=model, optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in steps:
            px.save(os.path.join(root, f"step{step}"), model=model, optimizer=opt, keep_last=1)
    return [str(w.message) for w in caught if "keep_last" in str(w.message)]


def test_keep_last_and_abandoned_saves_remove_only_what_saves_wrote(tmp_path):
    root = str(tmp_path)
    run_ranks(_keep_last, 2, args=(root, [1, 2]))
    assert sorted(os.listdir(root)) == ["step2"]
    # a checkpoint the user wrote into, the user's own entries shaped like leftovers, a real
    # leftover of an abandoned save of this job, and one of another job
    run_ranks(_keep_last, 2, args=(root, [3]))
    job = json.load(open(os.path.join(root, "step3", "manifest.json")))["job"]
    other = "ba9876543210"
    with open(os.path.join(root, "step3", "notes.txt"), "w") as f:
        f.write("keep me\n")
    os.makedirs(os.path.join(root, f"data.partial-{job}-{TOKEN}"))
    with open(os.path.join(root, f"data.partial-{job}-{TOKEN}", "table.csv"), "w") as f:
        f.write("a,b\n")
    with open(os.path.join(root, "notes.partial-2"), "w") as f:
        f.write("mine\n")
    for leftover in (f"step9.partial-{job}-{TOKEN}", f"b7.partial-{other}-{TOKEN}"):
        os.makedirs(os.path.join(root, leftover))
        with open(os.path.join(root, leftover, "rank00001.safetensors"), "wb") as f:
            f.write(b"\0" * 16)
    old = os.path.getmtime(os.path.join(root, "step3")) - 60
    for entry in os.listdir(root):
        os.utime(os.path.join(root, entry), (old, old))
    warned, _ = run_ranks(_keep_last, 2, args=(root, [4]))
    left = sorted(os.listdir(root))
    assert left == [f"b7.partial-{other}-{TOKEN}", f"data.partial-{job}-{TOKEN}",
                    "notes.partial-2", "step3", "step4"], left
    assert warned and "kept" in warned[0] and "step3" in warned[0], warned
    assert open(os.path.join(root, "step3", "notes.txt")).read() == "keep me\n"


def _export_to(path):
    model, _ = _prepared("zero3")
    try:
        px.export(path, model)
    except px.CheckpointError as exc:
        return str(exc)
    return None


def test_export_replaces_only_an_earlier_export(tmp_path):
    out = str(tmp_path / "model.safetensors")
    assert run_ranks(_export_to, 2, args=(out,)) == [None, None]
    assert run_ranks(_export_to, 2, args=(out,)) == [None, None]  # an earlier export: replaced
    notes = str(tmp_path / "notes.txt")
    with open(notes, "w") as f:
        f.write("not weights\n")
    errors = run_ranks(_export_to, 2, args=(notes,))
    assert all(e and "is not a safetensors file" in e for e in errors), errors
    assert open(notes).read() == "not weights\n"
    _user_project(str(tmp_path / "proj"))
    errors = run_ranks(_export_to, 2, args=(str(tmp_path / "proj"),))
    assert all(e and "is a directory" in e for e in errors), errors
    assert _tree(str(tmp_path / "proj"))["README.md"] == b"# my project\n"


def _save_unwrapped_zero3(root):
    model, opt = _prepared("zero3")
    errors = []
    for fn in (lambda: px.save(os.path.join(root, "c"), model=px.unwrap(model)),
               lambda: px.export(os.path.join(root, "w.safetensors"), px.unwrap(model))):
        try:
            fn()
        except ValueError as exc:
            errors.append(str(exc))
    px.save(os.path.join(root, "ok"), model=model, optimizer=opt)  # the ranks still meet
    return errors


def test_saving_the_module_inside_a_zero3_model_is_refused_naming_the_prepared_one(tmp_path):
    """The module inside a zero3 model holds no parameter values between uses: saving it is a
    clear error on every rank (it crashed in the write), and the prepared model saves."""
    for errors in run_ranks(_save_unwrapped_zero3, 2, args=(str(tmp_path),), timeout=120):
        assert len(errors) == 2
        assert all("pass the model px.prepare returned" in e for e in errors)
    assert px.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ok")


def _save_as(path, uid):
    """A save to `path` as user `uid` (None: as this process's): root writes anywhere, so a
    test run by root saves as another user, as a job of that user would."""
    model, opt = _prepared()
    if uid is not None:
        os.seteuid(uid)
    try:
        px.save(path, model=model, optimizer=opt)
    except px.CheckpointError as exc:
        return str(exc)
    finally:
        if uid is not None:
            os.seteuid(0)
    return None


@pytest.mark.parametrize("where", ["under a file", "read-only"])
def test_a_path_it_cannot_write_is_named_with_its_own_cause(tmp_path, where):
    """A save under a regular file (ENOTDIR) or into a directory this user may not write
    (EACCES) says so, and why; not that another process removed what it wrote (it once did)."""
    uid = None
    if where == "under a file":
        (tmp_path / "a_file").write_text("notes\n")
        parent = str(tmp_path / "a_file")
        errno_words, cause = "[Errno 20] Not a directory", f"{parent} is a file, not a directory"
    else:  # beside tmp_path: its parents are the test runner's alone, not another user's
        parent = tempfile.mkdtemp(prefix="phalanx-test-read-only-")
        os.chmod(parent, 0o555)
        uid = 65534 if os.geteuid() == 0 else None  # nobody
        errno_words, cause = "[Errno 13] Permission denied", f"cannot write in {parent}: "
    try:
        errors = run_ranks(_save_as, 2, args=(os.path.join(parent, "ckpt"), uid), timeout=120)
        listed = os.listdir(parent) if os.path.isdir(parent) else None
    finally:
        if where == "read-only":
            os.chmod(parent, 0o755)
            shutil.rmtree(parent)
    for rank, error in enumerate(errors):
        assert error is not None and errno_words in error and cause in error, (rank, error)
        assert "emptied" not in error and "another process" not in error, (rank, error)
        assert "give it a path in a directory this user can write to" in error, (rank, error)
    assert listed in (None, [])  # nothing written


@pytest.mark.one_process
def test_each_cause_of_a_failed_write_has_its_own_explanation(tmp_path):
    """What a rank's failed write adds to the error, by cause: the directory not writable
    (a read-only file system, here raised by hand), the disk full, the directory removed by
    another process while the ranks wrote it, and anything else left as it came."""
    from phalanx.checkpoint.saving import _failure, _Snapshot

    path = str(tmp_path / "ckpt")
    partial = f"{path}.partial-0123456789ab-{TOKEN}"
    snap = _Snapshot(path, partial, None)
    read_only = OSError(errno.EROFS, "Read-only file system", partial)
    assert _failure(read_only, snap, made=False).endswith(
        f"(cannot write in {tmp_path}: Read-only file system; give it a path in a directory "
        "this user can write to; nothing of this save was kept)")
    os.makedirs(partial)
    full = OSError(errno.ENOSPC, "No space left on device", partial)
    assert _failure(full, snap, made=True).endswith(
        f"(no space left in {tmp_path}: free some, or save elsewhere; nothing of this save was "
        "kept and the previous checkpoint stands)")
    assert _failure(ValueError("odd"), snap, made=True) == "ValueError: odd"
    os.rmdir(partial)
    gone = FileNotFoundError(errno.ENOENT, "No such file or directory", partial)
    assert "was removed or emptied while the ranks wrote it" in _failure(gone, snap, made=True)
    assert "was removed" not in _failure(gone, snap, made=False)
