"""The GPU acceptance suite: one command, one row per check with its number and its verdict.

    python benchmarks/gpu_accept.py                      # every check the GPUs present allow
    python benchmarks/gpu_accept.py --only parity,syncs  # checks whose names start so
    python benchmarks/gpu_accept.py --json accept.jsonl  # also one JSON line per check
    python benchmarks/gpu_accept.py --cpu-dry-run        # the same code on the CPU, small:
                                                         # exercises the script, proves nothing

Run from the repository root with PYTHONPATH=src (or phalanx installed); it needs torch (2.6 or
later for FSDP2's `fully_shard`), safetensors, numpy, tqdm and cloudpickle. On a machine without
CUDA it says so and exits 0 with every check skipped. On one H100 the whole suite takes a few
minutes; checks that need two or more GPUs (NCCL parity, the hang report on NCCL) are skipped
with that reason on a machine with one. Each check runs in a fresh interpreter
(`--child NAME`), so no check inherits another's process group, CUDA state or memory peak.

Settings: parity runs with TF32 off and deterministic
algorithms; timings take 5 warm-up steps and the median of 20 synchronised steps; competitors
run with `step_stats=False` where phalanx's report would add work they do not do. Models: TINY,
SMALL and GPT-2 124M of benchmarks/gpt.py (nanoGPT's shapes), trained on random tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_checks import CHECKS  # noqa: E402


def _gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run_child(name: str, dry: bool, timeout: float) -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(HERE.parent / "src"))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name] + \
        (["--cpu-dry-run"] if dry else [])
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"check": name, "verdict": "FAIL", "value": None,
                "detail": f"did not finish in {timeout:.0f} s"}
    took = time.monotonic() - start
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-6:]
        return {"check": name, "verdict": "FAIL", "value": None, "seconds": round(took, 1),
                "detail": "crashed: " + " | ".join(tail)}
    result = json.loads(lines[-1][len("RESULT "):])
    result["seconds"] = round(took, 1)
    return result


def _table(rows: list[dict]) -> str:
    out = [f"{'check':28} {'verdict':8} {'value':>14}  target / detail", "-" * 100]
    for r in rows:
        value = r.get("value")
        shown = f"{value:.4g}" if isinstance(value, float) else str(value if value is not None
                                                                      else "")
        out.append(f"{r['check']:28} {r['verdict']:8} {shown:>14}  {r.get('detail', '')}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated name prefixes")
    parser.add_argument("--json", default=None, help="write one JSON line per check here")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the checks' code on the CPU at small sizes (not an acceptance)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per check")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        check = CHECKS[args.child]
        result = {"check": args.child, **check.fn(dry=args.cpu_dry_run)}
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    import torch
    gpus = _gpus()
    prefixes = [p for p in args.only.split(",") if p]
    names = [n for n in CHECKS if not prefixes or any(n.startswith(p) for p in prefixes)]
    header = (f"phalanx GPU acceptance: {gpus} GPU(s)"
              + (f", {torch.cuda.get_device_name(0)}" if gpus else "")
              + f", torch {torch.__version__}, commit {_commit()}"
              + (" (CPU dry run: not an acceptance)" if args.cpu_dry_run else ""))
    print(header, flush=True)
    rows = []
    for name in names:
        check = CHECKS[name]
        if gpus == 0 and not args.cpu_dry_run:
            rows.append({"check": name, "verdict": "SKIP", "detail": "no CUDA device here"})
        elif args.cpu_dry_run and not check.dry:
            rows.append({"check": name, "verdict": "SKIP", "detail": "needs a GPU"})
        elif not args.cpu_dry_run and gpus < check.gpus:
            rows.append({"check": name, "verdict": "SKIP",
                         "detail": f"needs {check.gpus} GPUs, {gpus} here"})
        else:
            rows.append(_run_child(name, args.cpu_dry_run, args.timeout))
        print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print("\n" + header + "\n" + _table(rows))
    if gpus == 0 and not args.cpu_dry_run:
        print("\nNo CUDA device: every check skipped (this is not a failure).")
    if args.json:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps({**row, "header": header}) + "\n")
    failed = [r["check"] for r in rows if r["verdict"] == "FAIL"]
    print(f"\n{sum(r['verdict'] == 'PASS' for r in rows)} passed, {len(failed)} failed, "
          f"{sum(r['verdict'] == 'SKIP' for r in rows)} skipped")
    return 1 if failed else 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=HERE).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
