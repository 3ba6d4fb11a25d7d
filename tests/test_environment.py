"""The PHALANX_* variables: one table (src/phalanx/world/environment.py) that the docs page repeats,
each variable checked at the start by `px.init` on every rank and by `phalanx run` (the latter
in test_launch_checks.py), with an error that names it, its value and what it takes.
"""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx as px
from phalanx.observe import metrics
from phalanx.world import environment

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "environment.md"


@pytest.mark.one_process
def test_the_docs_table_is_the_modules_table():
    text = PAGE.read_text()
    section = text[text.index("## Read by phalanx"):text.index("Read by the test suite")]
    rows = [line for line in section.splitlines() if line.startswith("| `PHALANX_")]
    assert rows == environment.markdown_rows(), (
        "docs/reference/environment.md's table differs from src/phalanx/world/environment.py; "
        "paste in:\n" + "\n".join(environment.markdown_rows()))


@pytest.mark.one_process
def test_every_variable_read_in_src_is_in_the_table():
    read = set()
    for path in (ROOT / "src" / "phalanx").rglob("*.py"):
        read |= set(re.findall(r"\bPHALANX_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    read -= {"PHALANX_SLOW"}  # named in a comment of the test harness, read by tests/conftest.py
    assert sorted(read - set(environment.VARIABLES)) == []


def _environ_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each read of a PHALANX_* variable in `tree` that bypasses the table:
    `os.environ.get(N)`, `os.environ[N]` (not set or deleted), `N in os.environ`,
    `os.getenv(N)`, N a string or a module constant holding one. Setting one for a worker
    (`os.environ[N] = ...`, `setdefault`, `pop`) is not a read."""
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}

    def environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")) or \
            (isinstance(node, ast.Name) and node.id == "environ")

    def name(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) \
                and ((node.func.attr == "get" and environ(node.func.value))
                     or node.func.attr == "getenv"):
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and environ(node.comparators[0]):
            key = node.left
        if key is not None and (name(key) or "").startswith("PHALANX_"):
            found.append((node.lineno, name(key)))
    return sorted(found)


@pytest.mark.one_process
def test_the_variables_are_read_through_the_table_only():
    """[Note: one table of variables]: a variable read from os.environ elsewhere means what
    that place makes of it (`PHALANX_DEBUG_ELASTIC=0` once turned debugging on)."""
    sample = ('import os\nX = "PHALANX_A"\nos.environ.get(X); os.environ["PHALANX_B"]\n'
              '"PHALANX_C" not in os.environ; os.getenv("PHALANX_D")\n'
              'os.environ["PHALANX_E"] = "1"; os.environ.pop("PHALANX_F", None)\n')
    assert [n for _, n in _environ_reads(ast.parse(sample))] == \
        ["PHALANX_A", "PHALANX_B", "PHALANX_C", "PHALANX_D"]
    source = ROOT / "src" / "phalanx"
    reads = [f"{path.relative_to(source)}:{line}: {name}"
             for path in sorted(source.rglob("*.py")) if path.name != "environment.py"
             for line, name in _environ_reads(ast.parse(path.read_text()))]
    assert reads == [], ("read these through phalanx.world.environment.value(name):\n"
                         + "\n".join(reads))


def _not_a_dir(tmp_path) -> str:
    (tmp_path / "a_file").write_text("")
    return str(tmp_path / "a_file" / "below")


# variable -> (values it takes, with their meaning; values it refuses, with words of the fix)
GOOD = {
    "PHALANX_BACKEND": [("gloo", "gloo"), ("GLOO", "gloo"), ("cpu:gloo", "cpu:gloo")],
    "PHALANX_DEVICE": [("cpu", "cpu"), ("cuda:1", "cuda:1")],
    "PHALANX_PROCESSES": [("2", 2), ("auto", "auto")],
    "PHALANX_HANG_AFTER": [("7.5", 7.5), ("off", False)],
    "PHALANX_CHECK_COLLECTIVES": [("1", True), ("0", False)],
    "PHALANX_LOG_EVERY": [("1", 1), ("25", 25)],
    "PHALANX_TRACE": [("1", True), ("0", False)],
    "PHALANX_ON_FAILURE": [("continue", "continue"), ("stop", "stop")],
    "PHALANX_JOINING": [("0", 0), ("2", 2)],
    "PHALANX_DEBUG_ELASTIC": [("1", True)],
    "PHALANX_TTY": [(os.devnull, os.devnull)],
}
BAD = {
    "PHALANX_BACKEND": [("foo", "not a torch.distributed backend; one of gloo, nccl")],
    "PHALANX_DEVICE": [("gpu", "a device such as 'cpu', 'cuda'")],
    "PHALANX_PROCESSES": [("abc", "a number of worker processes, 1 or more"), ("0", "1 or more")],
    "PHALANX_HANG_AFTER": [("-1", "a positive number of seconds"), ("soon", "or 'off'"),
                           ("inf", "a positive number")],
    "PHALANX_CHECK_COLLECTIVES": [("yes", "1 turns it on, 0")],
    "PHALANX_LOG_EVERY": [("abc", "a whole number of steps, 1 or more"), ("0", "1 or more"),
                          ("-1", "1 or more"), ("2.5", "whole number")],
    "PHALANX_ON_FAILURE": [("carry-on", "one of 'continue', 'restart', 'stop'")],
    "PHALANX_JOINING": [("-1", "0 or more")],
    "PHALANX_DEBUG_ELASTIC": [("2", "1 turns it on")],
    "PHALANX_TTY": [("/dev/no-such-terminal", "no such terminal")],
}


@pytest.mark.one_process
@pytest.mark.parametrize("name", list(environment.VARIABLES))
def test_each_variable_takes_its_values_and_names_a_bad_one(name, tmp_path):
    for text, meant in GOOD.get(name, []):
        assert environment.value(name, {name: text}) == meant, (name, text)
    assert environment.value(name, {}) is None and environment.value(name, {name: " "}) is None
    bad = BAD.get(name, [])
    if name in ("PHALANX_RUN_DIR", "PHALANX_TRACE"):
        bad = [(_not_a_dir(tmp_path), "is a file, not a directory"),
               ("/proc/phalanx-test/x", "cannot write in /proc")]
    assert bad, name  # every row is exercised
    for text, words in bad:
        with pytest.raises(ValueError) as caught:
            environment.value(name, {name: text})
        assert str(caught.value).startswith(f"{name}={text!r}: ") and words in str(caught.value)


@pytest.mark.one_process
def test_a_directory_that_does_not_exist_yet_is_not_made(tmp_path):
    target = tmp_path / "runs" / "deeper"
    assert environment.value("PHALANX_RUN_DIR", {"PHALANX_RUN_DIR": str(target)}) == str(target)
    assert os.listdir(tmp_path) == []  # checked by a file made and removed in tmp_path


@pytest.mark.one_process
def test_check_names_every_bad_variable_at_once(tmp_path):
    env = {"PHALANX_LOG_EVERY": "0", "PHALANX_BACKEND": "foo", "PHALANX_TRACE": "1",
           "PHALANX_RUN_DIR": _not_a_dir(tmp_path), "PHALANX_JOINING": "x"}
    with pytest.raises(ValueError) as caught:
        environment.check(env, skip=["PHALANX_JOINING"])
    lines = str(caught.value).splitlines()
    assert lines[0] == "3 PHALANX_* variables are set to values they do not take:"
    assert [line.split("=")[0].strip() for line in lines[1:]] == \
        ["PHALANX_BACKEND", "PHALANX_RUN_DIR", "PHALANX_LOG_EVERY"]


@pytest.mark.one_process
def test_trace_into_the_default_run_directory_needs_a_writable_working_directory(tmp_path):
    (tmp_path / "runs").write_text("")  # runs/ under the working directory cannot be made
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        found = environment.problems({"PHALANX_TRACE": "1"})
    finally:
        os.chdir(cwd)
    assert len(found) == 1 and found[0].startswith("PHALANX_TRACE=1 writes to the run directory")


@pytest.mark.one_process
def test_px_init_checks_the_variables_before_joining(monkeypatch):
    px.shutdown()  # whatever an earlier test joined
    monkeypatch.setenv("PHALANX_LOG_EVERY", "abc")  # px.log read it only after training
    with pytest.raises(ValueError, match=r"^PHALANX_LOG_EVERY='abc': a whole number of steps"):
        px.init()
    assert not px.world.process.state.world.initialized


@pytest.mark.one_process
def test_px_log_names_the_variable_and_a_run_directory_it_cannot_make(monkeypatch, tmp_path):
    px.shutdown()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(metrics, "_lasting", {})
    px.init()
    try:  # set after px.init: read when used, and named there too
        monkeypatch.setenv("PHALANX_RUN_DIR", _not_a_dir(tmp_path))
        with pytest.raises(ValueError, match=r"PHALANX_RUN_DIR=.*is a file, not a directory"):
            px.log({"loss": 1.0}, step=1)
        monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path / "run"))
        monkeypatch.setenv("PHALANX_LOG_EVERY", "0")
        with pytest.raises(ValueError, match=r"PHALANX_LOG_EVERY='0'"):
            px.log({"loss": 1.0}, step=1)
    finally:
        metrics.close()
        px.shutdown()


@pytest.mark.one_process
def test_px_log_says_when_the_default_run_directory_cannot_be_made(monkeypatch):
    px.shutdown()
    monkeypatch.delenv("PHALANX_RUN_DIR", raising=False)
    monkeypatch.setattr(metrics, "_lasting", {})
    monkeypatch.chdir("/proc")  # runs/ cannot be made here, whoever runs the test
    with pytest.raises(OSError, match=r"cannot make the run directory runs/phalanx-.*; set "
                                      r"PHALANX_RUN_DIR to a directory this user can write to"):
        px.log({"loss": 1.0}, step=1)
    px.shutdown()


def test_every_rank_refuses_a_bad_variable_at_px_init_without_waiting(tmp_path):
    # Two ranks as torchrun starts them: each raises in px.init before the rendezvous, so
    # neither waits for the other (the rendezvous alone would wait px.init's 600 s).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text("import phalanx as px\npx.init()\nprint('JOINED', flush=True)\n")
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PHALANX_BACKEND="foo", PHALANX_LOG_EVERY="-1",
               PHALANX_TRACE=_not_a_dir(tmp_path))
    ranks = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(2)]
    try:
        outputs = [rank.communicate(timeout=60) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 1 and "JOINED" not in out, err
        assert "ValueError: 3 PHALANX_* variables are set to values they do not take:" in err
        for name in ("PHALANX_BACKEND='foo'", "PHALANX_LOG_EVERY='-1'", "PHALANX_TRACE="):
            assert f"  {name}" in err, err
