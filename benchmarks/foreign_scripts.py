"""Training scripts written elsewhere, run as written and as converted by coming-from.md, on CPU.

Four scripts that users bring with them: pytorch/examples' DDP tutorial script with its
snapshots (`distributed/ddp-tutorial-series/multigpu_torchrun.py`), its minGPT trainer
(`distributed/minGPT-ddp/mingpt`), its FSDP2 example with DCP checkpointing
(`distributed/FSDP2`), and Accelerate's `examples/by_feature/checkpointing.py`. This file holds
none of their code: it reads them from checkouts given on the command line, copies them into
a directory of runs, and edits the copies with the string replacements of
benchmarks/foreign_cases.py and foreign_accelerate.py (each must match as often as it says, or
the case stops and says which):

1. adaptations, applied alike to the original and to the converted copy, that let both run on
   2 CPU ranks and make their difference mean something: gloo and the CPU instead of NCCL and
   a GPU, a seed before anything random, float64 where the script allows it, a tiny model or
   configuration, and embedded or synthetic data where the original downloads a dataset or a
   pretrained model (each edit says why);
2. the conversion, applied to the converted copy only: exactly the rows of
   docs/getting-started/coming-from.md, as edits (each names its row).

The original runs under `torchrun --standalone --nproc_per_node 2`, the converted copy under
`phalanx run -n 2`, once per strategy, each in a fresh directory, one job at a time. A case
runs in phases (a first run, then a run that resumes from what the first one saved); after
each phase the weights the script itself saved (its snapshot or checkpoint) are read and
compared with the original's (max abs difference over every tensor), and so are the metrics it
printed (every number in the lines that carry them). The table gives, per script and strategy:
the lines the conversion changed, each phase's outcome (ok, or the first line of the error),
and the differences.

Reproduce (the checkouts are plain clones; any directory outside the repository does):

    git clone https://github.com/pytorch/examples /tmp/foreign/examples
    git clone https://github.com/huggingface/accelerate /tmp/foreign/accelerate
    .venv/bin/pip install accelerate          # runs Accelerate's original; not a dependency
    .venv/bin/python benchmarks/foreign_scripts.py \\
        --examples /tmp/foreign/examples --accelerate /tmp/foreign/accelerate \\
        --runs /tmp/foreign/runs

All of it took 11 minutes on a 2-core AMD EPYC. `--only NAME` (repeatable) runs one case:
tutorial, mingpt, mingpt-amp, fsdp2, accelerate. The original and the converted copies stay in
--runs (`diff -r RUNS/tutorial/original RUNS/tutorial/zero3` shows the conversion); `--show-diff`
prints it.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from foreign_accelerate import ACCELERATE
from foreign_cases import CASES, Case, Edit

TIMEOUT_S = 900  # one phase of one run; none took over 2 minutes on 2 cores
ERROR = re.compile(r"\b([A-Z]\w*(?:Error|Exception))\b(: .*)?$")
RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
GLOO_PLACE = re.compile(r"\[/\S+:\d+\] ")  # gloo's source file and line in its messages


@dataclass
class PhaseResult:
    ok: bool
    error: str = ""
    state: dict = field(default_factory=dict)
    metrics: list = field(default_factory=list)


def apply_edits(root: Path, edits) -> None:
    """Each edit replaces its `old` text, which must occur exactly once in its file."""
    for edit in edits:
        path = root / edit.path
        text = path.read_text()
        found = text.count(edit.old)
        if found != edit.count:
            raise SystemExit(f"{path}: the text to replace for {edit.why!r} occurs {found} "
                             f"times (expected {edit.count}); has the original changed?\n"
                             f"{edit.old}")
        path.write_text(text.replace(edit.old, edit.new))


def materialise(case: Case, checkouts: dict, where: Path, strategy: str | None,
                drop=()) -> None:
    """The case's files under `where`: adapted, and converted for `strategy` unless None."""
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True)
    source = Path(checkouts[case.source]) / case.folder
    for name in case.files:
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, where / name)
    for name, text in case.standins.items():
        (where / name).write_text(text)
    apply_edits(where, case.adapt)
    if strategy is not None:
        edits = [e for e in case.convert if e.key not in drop]
        apply_edits(where, [Edit(e.path, e.old, e.new.replace("{strategy}", strategy), e.why,
                                 e.key, e.count) for e in edits])


def lines_changed(original: Path, converted: Path, files) -> tuple[int, int]:
    """(lines added, lines removed) from the adapted original to the converted copy."""
    added = removed = 0
    for name in files:
        a = (original / name).read_text().splitlines()
        b = (converted / name).read_text().splitlines()
        for line in difflib.unified_diff(a, b, lineterm="", n=0):
            if line.startswith(("+++", "---")):
                continue
            added += line.startswith("+")
            removed += line.startswith("-")
    return added, removed


def first_error(output: str) -> str:
    """The first line of the first exception a rank printed (or the output's last line)."""
    lines = [GLOO_PLACE.sub("", RANK_PREFIX.sub("", line)).strip()
             for line in output.splitlines()]
    for line in lines:
        m = ERROR.search(line)
        if m and not line.startswith(("File ", "raise ", "During handling")):
            return line[:160]
    tail = [line for line in lines if line]
    return tail[-1][:160] if tail else "no output"


def launch(where: Path, converted: bool, args) -> tuple[int, str]:
    if converted:
        command = [sys.executable, "-m", "phalanx", "run", "-n", "2"]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    try:
        done = subprocess.run(command + list(args), check=False, cwd=where, env=env,
                              timeout=TIMEOUT_S,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\nTimeoutExpired: no end after {TIMEOUT_S} s"
    return done.returncode, done.stdout


def run_phases(case: Case, where: Path, converted: bool) -> list[PhaseResult]:
    results = []
    for phase in case.phases:
        code, output = launch(where, converted, (case.script, *phase.args))
        (where / f"{phase.name}.log").write_text(output)
        metrics = [float(x) for line in output.splitlines()
                   for m in [case.metric.search(RANK_PREFIX.sub("", line))] if m
                   for x in m.groups() if x is not None]
        if code != 0:
            results.append(PhaseResult(False, first_error(output), metrics=metrics))
            break  # a resume needs what the failed phase should have saved
        try:
            state = case.final_state(where, phase.name)
        except Exception as e:  # noqa: BLE001 (reported in the table, not raised)
            results.append(PhaseResult(False, f"no saved state: {type(e).__name__}: {e}"[:160],
                                       metrics=metrics))
            break
        results.append(PhaseResult(True, state=state, metrics=metrics))
    return results


def max_difference(a: dict, b: dict) -> str:
    """The largest absolute difference over the tensors both hold, or why there is none."""
    if set(a) != set(b):
        return f"names differ: {sorted(set(a) ^ set(b))[:3]}"
    worst = 0.0
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape:
            return f"{name}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return f"{worst:.1e}"


def metric_difference(a: list, b: list) -> str:
    if not a and not b:
        return "none printed"
    if len(a) != len(b):
        return f"{len(b)} numbers vs {len(a)}"
    return f"{max(abs(x - y) for x, y in zip(a, b)):.1e}"


def run_case(case: Case, checkouts: dict, runs: Path, show_diff: bool) -> list[list[str]]:
    original = runs / case.name / "original"
    materialise(case, checkouts, original, None)
    reference = run_phases(case, original, converted=False)
    rows = []
    for label, strategy, drop in case.variants:
        where = runs / case.name / label
        materialise(case, checkouts, where, strategy, drop)
        added, removed = lines_changed(original, where, case.files)
        if show_diff:
            subprocess.run(["diff", "-r", "-u", str(original), str(where), "-x", "*.log",
                            "-x", "__pycache__", "-x", "checkpoints", "-x", "*.pt"],
                           check=False)
        results = run_phases(case, where, converted=True)
        for i, phase in enumerate(case.phases):
            ref = reference[i] if i < len(reference) else None
            got = results[i] if i < len(results) else None
            outcome = ("not run" if got is None else "ok" if got.ok else got.error)
            if ref is None or not ref.ok:
                diff = metrics = "original failed: " + (ref.error if ref else "not run")
            elif got is None or not got.ok:
                diff = metrics = "-"
            else:
                diff = max_difference(ref.state, got.state)
                metrics = metric_difference(ref.metrics, got.metrics)
            rows.append([case.title, label, f"+{added} -{removed}", phase.name, outcome,
                         diff, metrics])
            print(" | ".join(rows[-1]), flush=True)
    return rows


def _commit(directory, say_dirty: bool = False) -> str:
    try:
        out = subprocess.run(["git", "-C", str(directory), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        if not say_dirty:
            return out
        dirty = subprocess.run(["git", "-C", str(directory), "status", "--porcelain",
                                "--untracked-files=no"], check=False, capture_output=True,
                               text=True).stdout
        return out + (" with uncommitted changes" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def setup(checkouts: dict) -> str:
    """What the numbers were measured on: CPU, versions, commits."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import accelerate
        acc = f", accelerate {accelerate.__version__}"
    except ImportError:
        acc = ", accelerate not installed"
    here = Path(__file__).resolve().parent.parent
    return (f"{cpu}, {os.cpu_count()} cores; torch {torch.__version__}{acc}; 2 ranks, gloo\n"
            f"phalanx {_commit(here, say_dirty=True)}; "
            f"pytorch/examples {_commit(checkouts['examples'])}; "
            f"huggingface/accelerate {_commit(checkouts['accelerate'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", required=True, help="a checkout of pytorch/examples")
    parser.add_argument("--accelerate", required=True, help="a checkout of huggingface/accelerate")
    parser.add_argument("--runs", default="/tmp/foreign/runs", help="where the copies run")
    parser.add_argument("--only", action="append", help="a case's name (repeatable)")
    parser.add_argument("--show-diff", action="store_true", help="print each conversion's diff")
    args = parser.parse_args()
    checkouts = {"examples": args.examples, "accelerate": args.accelerate}
    runs = Path(args.runs).resolve()
    rows = []
    for case in [*CASES, ACCELERATE]:
        if args.only and case.name not in args.only:
            continue
        rows += run_case(case, checkouts, runs, args.show_diff)
    header = ["script", "converted run", "lines changed", "phase", "outcome",
              "weights: max abs diff", "printed metrics: max abs diff"]
    print("\n" + setup(checkouts) + "\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")


if __name__ == "__main__":
    main()
