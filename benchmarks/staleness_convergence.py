"""What one step of delay does to convergence: the loss after K steps with staleness 0 and 1,
same model, data and optimizer, float64, in one process.

    .venv/bin/python benchmarks/staleness_convergence.py [--steps 10 50 200]

The runs are the one-process references of tests/staleness_runs.py, which tests/test_staleness.py
proves equal (float64, 1e-10) to `px.prepare(..., staleness=1)` on 2 and 3 ranks, so the
numbers are those of the distributed runs. The loss reported for step K is the loss of the
global batch of step K on the weights after K updates have been computed (K-1 applied under
staleness 1, whose first step applies nothing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from staleness_runs import reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 50, 200])
    args = parser.parse_args()
    print("| optimizer | K | loss, staleness 0 | loss, staleness 1 | ratio |")
    print("|---|---|---|---|---|")
    for kind in ("sgd", "adamw"):
        for k in args.steps:
            losses = {}
            for staleness in (0, 1):
                seen = []
                reference(k + 1, kind, staleness=staleness, losses=seen)
                losses[staleness] = seen[-1]
            print(f"| {kind} | {k} | {losses[0]:.4f} | {losses[1]:.4f} | "
                  f"{losses[1] / losses[0]:.3f} |")


if __name__ == "__main__":
    main()
