"""What every test module shares: the helper modules, the slow cases, and a repeat loop.

tests/ is on sys.path, so the shared helpers (parity.py, small_mlp.py, checkpoint_runs.py,
load_clock.py: limits in seconds of an idle machine) are imported by name from the test modules.

Slow cases (`pytest.mark.slow`, most often one `pytest.param(..., marks=pytest.mark.slow)` of a
long matrix) are deselected unless PHALANX_SLOW=1 or the `-m` expression names `slow`:
`pytest -q` runs the quick suite (what CI runs), `PHALANX_SLOW=1 pytest -q` runs everything, and
`pytest -m slow` only the slow cases.

The one-process tier (`pytest.mark.one_process`): tests that start no process, no rank and no
subprocess (option checks, the planner, the layout, messages), for the edit-test loop:
`pytest -q -m one_process` runs them in well under a minute. A test so marked that starts a
process fails, saying so, so the mark cannot drift from what the test does.

PHALANX_REPEAT=N runs every selected test N times, its ids ending in `repeat1` .. `repeatN`, to
hunt a flaky test: `PHALANX_REPEAT=20 pytest -q -x tests/test_hangs.py`.
"""

import _posixsubprocess
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

_repeat = 1  # PHALANX_REPEAT, read in pytest_configure


def pytest_configure(config):
    global _repeat
    text = os.environ.get("PHALANX_REPEAT", "").strip()
    if text:
        try:
            _repeat = int(text)
        except ValueError:
            _repeat = 0
        if _repeat < 1:
            raise pytest.UsageError(f"PHALANX_REPEAT={text!r}: the number of times to run each "
                                    "test, a whole number of at least 1, such as 20")


@pytest.fixture
def _phalanx_repeat(request):
    """Which run of the test this is, 1 .. PHALANX_REPEAT."""
    return request.param


# trylast: after the test's own parametrize, so that the repeat id comes last
@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc):
    if _repeat > 1:
        metafunc.fixturenames.append("_phalanx_repeat")
        metafunc.parametrize("_phalanx_repeat", range(1, _repeat + 1), indirect=True,
                             ids=lambda i: f"repeat{i}")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PHALANX_SLOW") == "1" or re.search(r"\bslow\b", config.option.markexpr):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


class _StartedAProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _one_process_guard(request, monkeypatch):
    """Under `one_process`, starting any process (subprocess, multiprocessing, fork) fails."""
    if request.node.get_closest_marker("one_process") is None:
        return

    def refuse(*args, **kwargs):
        raise _StartedAProcess(f"{request.node.nodeid} is marked one_process but starts a "
                               "process: remove the mark (it belongs to the multi-process suite)")

    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)
    monkeypatch.setattr(subprocess, "_fork_exec", refuse, raising=False)
    monkeypatch.setattr(os, "fork", refuse)
    if hasattr(os, "posix_spawn"):
        monkeypatch.setattr(os, "posix_spawn", refuse)
