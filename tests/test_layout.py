"""The package's shape: no import circle between phalanx's modules, no file too long to read, and
every module named on the architecture page.

The length rule is one a whole class can keep: a module holds one concept, and a class is never
cut across files (by a mixin or by private writes from a sibling) to fit a count of lines, so
the bound is set where one class with its notes fits (FSDP2's largest, `FSDPParamGroup`, is
about 1,100 lines with its helpers; phalanx's largest concept files are well under 800).

The import graph counts every `import` and `from ... import` in a module, at its top and inside
functions alike (a lazy import is still a dependency; it only hides a circle from the
interpreter). A package's `__init__` counts as the package.
"""

from __future__ import annotations

import ast
import os

import pytest

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)

SRC = os.path.join(os.path.dirname(__file__), "..", "src", "phalanx")
TESTS = os.path.dirname(__file__)
MAX_LINES = 800


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module under src/phalanx."""
    found = {}
    for dirpath, _, files in os.walk(SRC):
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), os.path.join(SRC, ".."))
            parts = rel[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = os.path.join(dirpath, name)
    return found


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """The phalanx modules `module` imports (resolved to the longest known dotted name)."""
    is_package = path.endswith("__init__.py")
    package = module if is_package else module.rsplit(".", 1)[0]
    out = set()
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rsplit(".", 1)[0] if "." in name else ""
            if name and name != module and name.startswith("phalanx"):
                out.add(name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle_between_modules():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = _imports(name, path, set(modules))
        # A package imports its own submodules to re-export them: an edge down, never a circle
        # with a submodule's import of a sibling through the package.
        graph[name] = {d for d in deps if not (d.startswith(name + ".") and
                                               path.endswith("__init__.py"))}
        graph[name] = {d for d in graph[name] if not name.startswith(d + ".")}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


@pytest.mark.parametrize("where", [SRC, TESTS])
def test_no_file_over_the_line_bound(where):
    long = []
    for dirpath, _, files in os.walk(where):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    n = sum(1 for _ in f)
                if n > MAX_LINES:
                    long.append(f"{os.path.relpath(path, where)} ({n})")
    assert not long, f"files over {MAX_LINES} lines: {', '.join(long)}"


def test_every_module_is_on_the_architecture_page():
    """docs/concepts/architecture.md names every module of the package (by its file name, in
    backquotes), so a new module comes with the line that says what it is for."""
    page = os.path.join(SRC, "..", "..", "docs", "concepts", "architecture.md")
    with open(page) as f:
        text = f.read()
    missing = []
    for dirpath, _, files in os.walk(SRC):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), SRC).replace(os.sep, "/")
            if name.endswith(".py") and name not in ("__init__.py", "__main__.py") and \
                    f"`{name}`" not in text and f"`{rel}`" not in text:
                missing.append(rel)
    assert not missing, f"modules the architecture page does not name: {', '.join(missing)}"


def test_a_one_process_test_cannot_start_a_process():
    """The one_process tier's guard (tests/conftest.py): this module is marked one_process, so
    every way a test starts a process fails here instead of running."""
    import multiprocessing
    import subprocess
    import sys

    with pytest.raises(AssertionError, match="marked one_process but starts a process"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(AssertionError, match="marked one_process but starts a process"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(AssertionError, match="marked one_process but starts a process"):
        os.fork()


# The floors, bottom up: a room (a package, or a module where named) stands above what it
# imports. An import of a room on a higher floor runs back up; the few there are, are named.
FLOORS = [
    ("phalanx._tree", "phalanx.spec"),
    ("phalanx.world",),
    ("phalanx.comm",),
    ("phalanx.faults",),
    ("phalanx.world.runtime",),
    ("phalanx.engine",),
    ("phalanx.observe",),
    ("phalanx.model",),
    ("phalanx.planner",),  # on the model's spec (model/spec.py) and the engine's own layout
    ("phalanx.data",),
    ("phalanx.checkpoint",),
    ("phalanx.continuing",),
    ("phalanx.launch", "phalanx.testing"),
    # the public names, the commands (each sub-command's module beside its package's), the demo
    ("phalanx", "phalanx.cli", "phalanx.demo", "phalanx.__main__", "phalanx.launch.cli",
     "phalanx.planner.cli", "phalanx.observe.report_cli", "phalanx.checkpoint.cli",
     "phalanx.checkpoint.info_cli"),
    ("phalanx.integrations",),  # on the public names (`import phalanx`), which never import it
]
BACK_UP: set[tuple[str, str]] = set()   # (from room, to room) allowed to run back up a floor
# Imports inside a function, where one is wanted: a command's start kept light (its sub-command
# loads what it runs), and a px.spawn child importing phalanx after its environment is set.
LAZY_OK = ("cli", "demo", "launch.spawn", "launch.cli", "planner.cli", "observe.report_cli",
           "checkpoint.info_cli", "checkpoint.cli")


def _room(module: str) -> tuple[str, int]:
    best = max((r for floor in FLOORS for r in floor
                if module == r or module.startswith(r + ".")), key=len)
    return best, next(i for i, floor in enumerate(FLOORS) if best in floor)


def floor_arrows() -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """([(module, imported, its room, the imported room)] running back up a floor, [lazy imports
    of phalanx modules outside LAZY_OK, as 'module:line imported'])."""
    modules = _modules()
    up, lazy = [], []
    for name, path in sorted(modules.items()):
        room, floor = _room(name)
        for dep in sorted(_imports(name, path, set(modules))):
            dep_room, dep_floor = _room(dep)
            if dep_floor > floor and (room, dep_room) not in BACK_UP:
                up.append((name, dep, room, dep_room))
        tree = ast.parse(open(path).read())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                inner = (node.level or (node.module or "").startswith("phalanx")
                         if isinstance(node, ast.ImportFrom) else
                         isinstance(node, ast.Import) and
                         any(a.name.startswith("phalanx") for a in node.names))
                if inner and not name.removeprefix("phalanx.").startswith(LAZY_OK):
                    lazy.append(f"{name}:{node.lineno}")
    return up, sorted(set(lazy))


def test_no_import_runs_back_up_a_floor():
    """docs/concepts/architecture.md draws these floors: a room imports only rooms on its own
    floor or below, so that what a change touches is what stands above it."""
    up, _ = floor_arrows()
    assert not up, "imports running back up a floor:\n" + "\n".join(
        f"  {a} ({ra}) -> {b} ({rb})" for a, b, ra, rb in up)


def test_no_import_hides_inside_a_function():
    """An import inside a function hides a dependency (and often a circle) from the reader and
    from the interpreter: only a command's light start and a spawned child have them."""
    _, lazy = floor_arrows()
    assert not lazy, f"phalanx imports inside functions: {', '.join(lazy)}"


def test_the_comm_keeps_the_name_the_docs_gave_it():
    """`phalanx.collectives.Comm` (px.prepare's `comm=`) was documented before the communication
    layer had its folder; it still names the same class."""
    from phalanx.collectives import Comm as documented
    from phalanx.comm.collectives import Comm

    assert documented is Comm


def test_no_import_circle_between_the_benchmarks():
    """benchmarks/ imports its own modules by name (a check module, a model, a timer): none of
    them, at the top or inside a function, closes a circle."""
    where = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
    names = {f[:-3] for f in os.listdir(where) if f.endswith(".py")}
    graph = {}
    for name in names:
        tree = ast.parse(open(os.path.join(where, name + ".py")).read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                deps.add(node.module or "")
        graph[name] = {d for d in deps if d in names and d != name}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"
