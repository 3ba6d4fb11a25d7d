"""One benchmark, two source trees of phalanx, side by side in one run: before and after a change.

    git archive OLD_COMMIT src | tar -x -C /tmp/before
    .venv/bin/python benchmarks/trees.py /tmp/before/src src --repeats 3 -- \
        benchmarks/ddp.py --models mlp --rounds 5

The benchmark after `--` runs `--repeats` times with each tree first on PYTHONPATH, the trees
taking turns (before, after, before, ...), so both see the same machine drift. Each run's table
rows (a name, then numbers) are collected; the table printed gives, per row and column, the
median over the repeats for each tree and after / before. The benchmarks themselves compare
phalanx with torch DDP or FSDP2 inside each run, so their ratio columns are the ones to read:
a change that leaves phalanx as fast (or as small) leaves them within the run-to-run noise.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

ROW = re.compile(r"^([A-Za-z][\w .+/()-]*?)\s{2,}(-?[\d.]+(?:\s+-?[\d.]+)*)\s*$")


def rows(output: str) -> dict[str, list[float]]:
    """{row name: its numbers} of every line shaped as a table row (a name, two spaces or more,
    then numbers only), named with the section it follows when names repeat."""
    out, section = {}, ""
    for line in output.splitlines():
        match = ROW.match(line.strip())
        if match is None:
            if line.strip() and not line.startswith(" "):
                section = line.strip()[:40]
            continue
        name = match.group(1).strip()
        key = name if name not in out else f"{section}: {name}"
        out[key] = [float(x) for x in match.group(2).split()]
    return out


def run(tree: str, command: list[str]) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    done = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} with {tree} failed:\n{done.stderr[-3000:]}")
    print(done.stdout, flush=True)
    return rows(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--repeats", type=int, default=3)
    argv = sys.argv[1:]
    if "--" not in argv:
        parser.error("give the benchmark after --: ... -- benchmarks/ddp.py --models mlp")
    cut = argv.index("--")
    args, command = parser.parse_args(argv[:cut]), argv[cut + 1:]
    got = {"before": [], "after": []}
    for _ in range(args.repeats):
        for which in ("before", "after"):
            got[which].append(run(getattr(args, which), command))
    print(f"\n{' '.join(command)}: median of {args.repeats} runs of each tree, taking turns")
    print(f"{'row':40s} {'column':>6s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for name in got["before"][0]:
        if not all(name in r for r in got["before"] + got["after"]):
            continue
        for col in range(len(got["before"][0][name])):
            b = statistics.median(r[name][col] for r in got["before"])
            a = statistics.median(r[name][col] for r in got["after"])
            ratio = f"{a / b:13.3f}" if b else f"{'-':>13s}"
            print(f"{name[:40]:40s} {col:6d} {b:10.3f} {a:10.3f} {ratio}")


if __name__ == "__main__":
    main()
