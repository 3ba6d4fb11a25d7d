"""The reference in docs/ covers what the code offers, and names only what exists.

Fails when a public name of `phalanx.__all__`, a `PHALANX_*` variable read in src/, a command or
flag of the `phalanx` command, or an exception class defined in phalanx has no entry in
docs/reference/; and when README.md or a page under docs/ names a file of the repository that
does not exist. (`bash scripts/docs.sh` then renders the entries: a `::: phalanx.NAME` that does
not resolve, or a broken link, fails that strict build.)
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import phalanx
from phalanx.cli import COMMANDS, build_parser

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _text(name: str) -> str:
    return (REFERENCE / name).read_text()


def test_every_public_name_has_an_entry_in_the_api_reference():
    api = _text("api.md")
    documented = set(re.findall(r"^::: phalanx\.(\w+)\s*$", api, re.M))
    missing = [name for name in phalanx.__all__ if name not in documented]
    assert not missing, f"docs/reference/api.md has no `::: phalanx.NAME` for {missing}"
    extra = sorted(documented - set(phalanx.__all__))
    assert not extra, f"docs/reference/api.md documents names that are not public: {extra}"


def _variables_read_in_src() -> set[str]:
    found = set()
    for path in (ROOT / "src" / "phalanx").rglob("*.py"):
        found |= set(re.findall(r"\bPHALANX_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return found


def test_every_phalanx_variable_read_in_src_has_an_entry():
    variables = _variables_read_in_src()
    assert len(variables) >= 5, variables
    rows = set(re.findall(r"^\| `(PHALANX_\w+)`", _text("environment.md"), re.M))
    missing = sorted(variables - rows)
    assert not missing, f"docs/reference/environment.md has no row for {missing}"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _section(text: str, heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    return m.group(1) if m else ""


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_and_flag_has_an_entry_in_the_cli_reference(command):
    section = _section(_text("cli.md"), f"phalanx {command}")
    assert section, f"docs/reference/cli.md has no section '## phalanx {command}'"
    rows = "\n".join(line for line in section.splitlines() if line.startswith("| `"))
    missing = []
    for action in _subcommands()[command]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = action.option_strings or [action.metavar or action.dest]
        if isinstance(action.choices, (list, tuple, dict)) and not action.option_strings:
            names = list(action.choices)  # a positional that takes a word, such as `info`
        for name in names:
            if not re.search(rf"`{re.escape(str(name))}[` ]", rows):
                missing.append(name)
    assert not missing, f"'phalanx {command}': no row in docs/reference/cli.md for {missing}"


def _exception_classes() -> dict[str, type]:
    classes = {}
    for info in pkgutil.walk_packages(phalanx.__path__, "phalanx."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                classes[obj.__name__] = obj
    return classes


def test_every_exception_class_has_an_entry_in_the_errors_reference():
    classes = _exception_classes()
    exported = {n for n in phalanx.__all__ if inspect.isclass(getattr(phalanx, n))
                and issubclass(getattr(phalanx, n), BaseException)}
    assert exported <= set(classes), exported - set(classes)
    text = _text("errors.md")
    headings = set(re.findall(r"^#{2,3} (\w+)", text, re.M))
    headings |= {w for h in re.findall(r"^#{2,3} (.+)$", text, re.M) for w in re.findall(r"\w+", h)}
    missing = sorted(set(classes) - headings)
    assert not missing, f"docs/reference/errors.md has no section for {missing}"
    for name in exported:  # each exported error: an example message in a text block
        section = _section(text, name)
        assert "```text" in section, f"errors.md: '## {name}' shows no example message"


# Files of the repository named in backticks, e.g. `src/phalanx/engine/zero3.py`, `tests/test_*.py`.
PATH = re.compile(r"`((?:src/phalanx|benchmarks|tests|scripts|docs)/[\w./*-]*[\w*])`")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_file_a_page_names_exists(page):
    missing = []
    for name in sorted(set(PATH.findall(page.read_text()))):
        if not list(ROOT.glob(name)):
            missing.append(name)
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


def _slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"`|\*\*|\[([^]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_leads_to_a_page_and_heading(page):
    """The site's strict build checks the pages under docs/; this checks README.md too, whose
    links a reader follows on the repository."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#{1,6} (.+?)\s*$", file.read_text(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_the_readme_is_short_and_starts_with_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    first = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert first[0].startswith("bash scripts/setup.sh && .venv/bin/phalanx demo ")
    assert first[1].startswith(".venv/bin/python -m pytest -q ")
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = first[1].split("#")[0].strip()  # the README's, as CI runs it
    for command in ("bash scripts/setup.sh", test_command, "bash scripts/docs.sh"):
        assert command in ci, f".ci/run does not run {command!r}"


def _rendered_docstrings():
    """(name, docstring) of what docs/reference/api.md renders: each `::: phalanx.NAME`, and
    for a class its `__init__` (merged into it) and its public members."""
    for name in re.findall(r"^::: phalanx\.(\w+)\s*$", _text("api.md"), re.M):
        obj = getattr(phalanx, name)
        yield name, inspect.getdoc(obj) or ""
        if not inspect.isclass(obj):
            continue
        members = [("__init__", obj.__dict__.get("__init__"))]
        members += [(k, v) for k, v in vars(obj).items() if not k.startswith("_")]
        for member, value in members:
            value = getattr(value, "__func__", value)  # staticmethod, classmethod
            value = getattr(value, "fget", value)      # property
            if callable(value) and value.__doc__:
                yield f"{name}.{member}", inspect.cleandoc(value.__doc__)


# A pointer into the source instead of what a reader of the page needs: a file of the package
# (zero3.py, engine/optim.py), a named invariant ([Note: ...]), or "the module's notes".
POINTER = re.compile(r"\b[\w/]+\.py\b|\[Note\b|\bmodule'?s? (notes|docstring)\b", re.I)


def test_the_api_reference_says_what_a_user_needs_without_sending_them_into_the_source():
    pointing = [f"{name}: {line.strip()}" for name, doc in _rendered_docstrings()
                for line in doc.splitlines() if POINTER.search(line)]
    assert len(dict(_rendered_docstrings())) > 40  # every entry, with the classes' members
    assert not pointing, ("these docstrings rendered by docs/reference/api.md send the reader "
                          "into the source (say it on the page; keep pointers for maintainers "
                          "in comments):\n" + "\n".join(pointing))
