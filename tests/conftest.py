"""What every test module shares: the helper modules, the slow cases, and a repeat loop.

tests/ is on sys.path, so the shared helpers (parity.py, small_mlp.py, checkpoint_runs.py) are
imported by name from the test modules.

Slow cases (`pytest.mark.slow`, most often one `pytest.param(..., marks=pytest.mark.slow)` of a
long matrix) are deselected unless PHALANX_SLOW=1 or the `-m` expression names `slow`:
`pytest -q` runs the quick suite (what CI runs), `PHALANX_SLOW=1 pytest -q` runs everything, and
`pytest -m slow` only the slow cases.

PHALANX_REPEAT=N runs every selected test N times, its ids ending in `repeat1` .. `repeatN`, to
hunt a flaky test: `PHALANX_REPEAT=20 pytest -q -x tests/test_hangs.py`.
"""

import os
import re
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
