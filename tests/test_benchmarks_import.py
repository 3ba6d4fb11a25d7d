"""Every script under benchmarks/ imports (its names resolve, its helpers are where it looks),
so a rename in the package is caught here rather than when a benchmark is next run. One
interpreter imports them all, with benchmarks/ on the path as when a script runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

CHECK = """
import importlib, sys, traceback
sys.path.insert(0, sys.argv[1])
sys.argv = ["benchmark"]
failed = []
for name in sys.argv_names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name.split(".")[0] in ("transformers", "peft", "accelerate", "torchft", "ray"):
            continue  # an optional package the benchmark needs, absent here
        failed.append(f"{name}: {exc!r}")
    except Exception as exc:
        failed.append(f"{name}: {traceback.format_exc(limit=3)}")
print("\\n".join(failed))
"""


def test_every_benchmark_script_imports():
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    code = CHECK.replace("sys.argv_names", repr(names))
    # (plan_vs_measured.py starts itself again unless glibc's mmap threshold is set)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True,
                          text=True, timeout=300, cwd=BENCHMARKS, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", done.stdout
