"""Every example of code in README.md and docs/ runs as it is written.

An example is a fenced block of `python` or `bash` (also `py`, `sh`, `shell`, `console`); blocks
of `text` are output, not code. The line right above a fence may say how to run it:

    <!-- test: ranks=2 -->            on 2 CPU ranks (gloo), through phalanx.testing.run_ranks
    <!-- test: setup=toy -->          with MyModel, train_set and epochs defined first (TOY below)
    <!-- test: setup=checkpoint -->   (shell) in a directory holding checkpoints/step0 (CHECKPOINT)
    <!-- test: setup=run -->          (shell) in a directory holding the run runs/example (RUN)
    <!-- test: script -->             saved as a file and run as `python script.py` (a script that
                                      starts its own workers, px.init(processes=N))
    <!-- test: output -->             its output must be exactly the `text` block right after it
    <!-- test: skip (why) -->         a fragment or a command that needs what a test cannot have
                                      (your script, a GPU, a second machine, SLURM); the reason
                                      is required

Without a mark, a Python example runs in a process of its own (a world of one) and a shell
example through `bash -e` with .venv's commands first on PATH, each in an empty directory. A
shell example made only of `phalanx plan|checkpoint|export|report` commands runs each through
`phalanx.cli.main` in a forked process instead (the same code, without a new interpreter that
imports torch again: the test stays within a minute).

Each example is bounded by a limit (a hang ends its test), in seconds of an idle machine
(tests/load_clock.py): LIMIT for a command or a script (the longest, the Lightning page's
`python train.py`, starts a second interpreter and trains two epochs on two processes), 90 s for
ranks run in forked processes. On a machine shared with other work the limit stretches with the
load, as the job does: a fixed 120 s failed that page's example at load 13-18 on two cores.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import load_clock
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash",
        "console": "bash"}
LIMIT = 120  # seconds of an idle machine for a shell example or a script (load_clock.run)
MARK = re.compile(r"<!--\s*test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
OPTION = re.compile(r"skip \((?P<why>[^)]+(?:\([^)]*\)[^)]*)*)\)|ranks=(?P<ranks>\d+)|"
                    r"setup=(?P<setup>toy|checkpoint|run)|(?P<script>script)|(?P<output>output)")

# What `setup=toy` defines: the stand-ins for the reader's model and data.
TOY = '''
import torch
class MyModel(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
_g = torch.Generator().manual_seed(0)
train_set = torch.utils.data.TensorDataset(torch.randn(96, 16, generator=_g),
                                           torch.randint(0, 4, (96,), generator=_g))
epochs = 2
'''

# What `setup=checkpoint` and `setup=run` leave in the example's directory, made in a forked
# process before the shell example runs.
def _make_checkpoint():
    import torch

    import phalanx as px

    model = torch.nn.Linear(4, 2)
    px.save("checkpoints/step0", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            step=0)


def _make_run():
    import os

    import torch

    import phalanx as px

    os.environ["PHALANX_RUN_DIR"] = "runs/example"
    model = torch.nn.Linear(8, 1)
    model, optimizer = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(5):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        px.log({"loss": loss.item(), **px.step_stats(model)})


SETUPS = {"checkpoint": _make_checkpoint, "run": _make_run}
IN_PROCESS = re.compile(r"^phalanx (plan|checkpoint|export|report)\b[^|&;<>$`]*$")


@dataclass
class Example:
    path: Path
    line: int
    lang: str
    code: str
    mark: str | None
    expected: str | None = None  # the `text` block right after it

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def options(self) -> dict:
        found: dict = {}
        rest = self.mark or ""
        for m in OPTION.finditer(rest):
            found.update({k: v for k, v in m.groupdict().items() if v is not None})
        leftover = OPTION.sub("", rest).strip(" ,")
        if leftover:
            raise ValueError(f"{self.name}: unknown test option {leftover!r} in {self.mark!r}")
        return found


def examples(paths=SOURCES) -> list[Example]:
    found = []
    for path in paths:
        lines = path.read_text().splitlines()
        i, mark = 0, None
        while i < len(lines):
            stripped = lines[i].strip()
            m = MARK.fullmatch(stripped)
            if m:
                mark = (m.group(1), i)
                i += 1
                continue
            f = FENCE.match(lines[i])
            if f:
                indent, fence, lang = f.groups()
                j, body = i + 1, []
                while j < len(lines) and not lines[j].strip().startswith(fence):
                    body.append(lines[j][len(indent):])
                    j += 1
                own = mark[0] if mark is not None and mark[1] == i - 1 else None
                if mark is not None and own is None:
                    raise ValueError(f"{path.relative_to(ROOT)}:{mark[1] + 1}: a test mark must "
                                     "be on the line right above a fence")
                if lang in CODE:
                    found.append(Example(path, i + 1, CODE[lang], "\n".join(body) + "\n", own,
                                         _text_after(lines, j + 1)))
                elif own is not None:
                    raise ValueError(f"{path.relative_to(ROOT)}:{i + 1}: a test mark above a "
                                     f"block of {lang or 'plain text'}, which is not run")
                mark, i = None, j + 1
                continue
            if stripped and mark is not None:
                raise ValueError(f"{path.relative_to(ROOT)}:{mark[1] + 1}: a test mark must be "
                                 "on the line right above a fence")
            i += 1
    return found


def _text_after(lines: list[str], start: int) -> str | None:
    """The body of a `text` block that follows (blank lines apart), else None."""
    k = start
    while k < len(lines) and not lines[k].strip():
        k += 1
    if k < len(lines) and lines[k].strip() in ("```text", "```console"):
        end = k + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        return "\n".join(lines[k + 1:end])
    return None


def _same_text(got: str, expected: str) -> bool:
    return [l.rstrip() for l in got.strip().splitlines()] == \
        [l.rstrip() for l in expected.strip().splitlines()]


ALL = examples()
# An example shown on two pages (the README's loop and the first guide's) runs once.
RUN = list({(e.lang, e.code, e.mark): e for e in reversed(ALL) if "why" not in e.options()}
           .values())[::-1]


@pytest.mark.one_process
def test_every_example_is_run_or_says_why_not():
    assert len(ALL) > 20, "the example finder found too few examples"
    for e in ALL:
        opts = e.options()
        if "why" in opts:
            assert len(opts["why"].split()) >= 3, f"{e.name}: give a reason to skip"
            assert len(opts) == 1, f"{e.name}: a skipped example takes no other option"
        if "output" in opts:
            assert e.expected is not None, f"{e.name}: `output` needs a text block after it"
            assert e.lang == "bash", f"{e.name}: `output` is for shell examples"
    skipped = sum("why" in e.options() for e in ALL)
    assert len(ALL) - skipped >= 2 * skipped, (f"{skipped} of {len(ALL)} examples are skipped: "
                                               "make examples runnable")


def _in_process(code: str) -> list[list[str]] | None:
    """The example's commands as argument lists, when each is a `phalanx` command runnable
    in-process; else None (run it through bash)."""
    lines = [l.strip() for l in code.splitlines() if l.strip() and not l.strip().startswith("#")]
    if not lines or not all(IN_PROCESS.match(l) for l in lines):
        return None
    return [shlex.split(l, comments=True)[1:] for l in lines]


def _run_cli(commands: list[list[str]], where: str):
    import contextlib
    import io

    from phalanx.cli import main

    os.chdir(where)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for argv in commands:
            assert main(argv) == 0, f"phalanx {' '.join(argv)} failed:\n{out.getvalue()}"
    return out.getvalue()


def _call_in(fn, where: str):
    os.chdir(where)
    fn()


def _exec_example(code: str, where: str):
    os.chdir(where)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "<example>", "exec"), namespace)  # the docs' own examples


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PHALANX_RUN_DIR"] = "runs/docs-example"
    return env


@pytest.mark.parametrize("example", RUN, ids=[e.name for e in RUN])
def test_example_runs(example, tmp_path, monkeypatch):
    opts = example.options()
    code = (TOY if opts.get("setup") == "toy" else "") + example.code
    if example.lang == "python":
        assert opts.get("setup") in (None, "toy"), f"{example.name}: a shell setup on Python"
    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path / "runs" / "example"))
    if example.lang == "bash" and opts.get("setup") in SETUPS:
        from phalanx.testing import run_ranks

        run_ranks(_call_in, world_size=1, args=(SETUPS[opts["setup"]], str(tmp_path)),
                  timeout=load_clock.scaled(60))
    commands = _in_process(example.code) if example.lang == "bash" else None
    if commands is not None:
        from phalanx.testing import run_ranks

        stdout = run_ranks(_run_cli, world_size=1, args=(commands, str(tmp_path)),
                           timeout=load_clock.scaled(90))[0]
        if "output" in opts:
            assert _same_text(stdout, example.expected), (
                f"{example.name} prints something else than the page shows:\n{stdout}")
    elif example.lang == "bash":
        done = load_clock.run(["bash", "-e", "-o", "pipefail", "-c", code], LIMIT,
                              cwd=tmp_path, env=_clean_env())
        assert done.returncode == 0, f"{example.name}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        if "output" in opts:
            assert _same_text(done.stdout, example.expected), (
                f"{example.name} prints something else than the page shows:\n{done.stdout}")
    elif "script" in opts:
        script = tmp_path / "script.py"
        script.write_text(code)
        done = load_clock.run([sys.executable, str(script)], LIMIT, cwd=tmp_path,
                              env=_clean_env())
        assert done.returncode == 0, f"{example.name}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    else:
        from phalanx.testing import run_ranks

        run_ranks(_exec_example, world_size=int(opts.get("ranks", 1)),
                  args=(code, str(tmp_path)), timeout=load_clock.scaled(90))
