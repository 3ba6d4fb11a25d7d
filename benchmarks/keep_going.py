"""How long a failure stops training: `phalanx run --on-failure continue` against `restart`.

    .venv/bin/python benchmarks/keep_going.py                 # 3 ranks, 3 rounds of each mode
    .venv/bin/python benchmarks/keep_going.py --rounds 5 --ranks 4
    .venv/bin/python benchmarks/keep_going.py --part overhead   # no failure: the vote's cost
    .venv/bin/python benchmarks/keep_going.py --strategy zero2  # a sharded job: it reloads

The job: the 12.6M-parameter MLP of benchmarks/ddp.py (6 blocks of Linear 512 -> 2048 -> 512,
fp32, AdamW) under ddp (or `--strategy`), 16 x 512 per rank of a fixed global batch drawn through
px.data_loader, a px.save every `--save-every` steps (background=False), the README's resume
lines. Each round starts the job, waits `--warmup` steps, SIGKILLs rank 1 at a moment drawn
inside a step, and reads every rank's per-step timestamps (`TICK`, printed after each
`optimizer.step()`). Modes alternate within a round, so both see the same machine.

- continue (`--on-failure continue --max-restarts 1`): seconds from the kill to the first
  step committed after it (the survivors' redo of the step in flight), and to the first step
  committed at full size again (the replacement admitted at a save);
- restart (`--on-failure restart --max-restarts 1`): seconds from the kill to the first step
  completed by the restarted workers.
- For both, the global steps trained twice: committed before the kill and trained again after
  it (restart: those since the last checkpoint; continue: none, the step in flight was never
  committed).

Prints one row per round and the medians. Each `TICK` also names the samples the rank's batch
held (`idx=`), so that benchmarks/torchft_compare.py, which imports the pieces below, counts
the samples that never reached an applied update by one rule for every competitor.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(args) -> None:
    import torch

    import phalanx as px
    import phalanx.continuing as continuing

    sys.path.insert(0, str(HERE.parent))
    from ddp import make

    px.init()
    torch.manual_seed(0)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("PHALANX_JOINING", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = make("mlp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = px.prepare(model, optimizer, strategy=args.strategy)
    g = torch.Generator().manual_seed(1)
    samples = args.steps * 48
    data = torch.utils.data.TensorDataset(torch.randn(samples, 512, generator=g),
                                          torch.arange(samples))
    per_rank = 48 // int(os.environ["WORLD_SIZE"])
    loader = px.data_loader(data, batch_size=per_rank, shuffle=False)
    step = 0
    ckpt = px.latest_checkpoint(args.ckpt)
    if ckpt is not None:
        step = px.load(ckpt, model=model, optimizer=optimizer, sampler=loader.sampler)["step"]
    for x, index in loader:
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        steps = continuing.now().steps if continuing.continuing() else None  # continuing/steps.py
        done = steps is None or steps.last_voted == steps.calls  # a lost step is dropped
        print(f"TICK rank={rank} life={life} restart={restart} step={step} done={int(done)} "
              f"at={loader.sampler.position() // 48} world={px.world_size()} "
              f"t={time.time():.4f} idx={spans(index.tolist())}", flush=True)
        if step % args.save_every == 0:
            px.save(os.path.join(args.ckpt, f"step{step:05d}"), model=model,
                    optimizer=optimizer, sampler=loader.sampler, step=step, keep_last=2)
    px.shutdown()


def spans(indices) -> str:
    """`0:16,32:48` for the samples 0..15 and 32..47 (the `idx=` of a TICK)."""
    out, indices = [], sorted(indices)
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return ",".join(f"{a}:{b}" for a, b in out) or "none"


def unspan(text: str) -> set[int]:
    return {i for part in text.split(",") if part != "none"
            for i in range(*map(int, part.split(":")))}


def parse_tick(line: str, fields: int):
    """The fields of a `TICK` line, or None for another line or one cut by another's output."""
    m = re.search(r"TICK (.*)$", line)
    if not m:
        return None
    tick = dict(re.findall(r"(\w+)=([\w.:,]+)", m.group(1)))
    return tick if len(tick) == fields and "idx" in tick else None


def watch_and_kill(stream, args, rng, victim, fields: int) -> tuple[list[dict], float]:
    """Every TICK read from `stream` (to its end), and the time of the kill: once rank 1 has
    done `args.warmup` steps, the process `victim()` names is SIGKILLed at a moment drawn
    inside the next step."""
    ticks: list[dict] = []
    killed_at = None
    for line in stream:
        tick = parse_tick(line, fields)
        if tick is None:
            continue
        ticks.append(tick)
        if killed_at is None and tick["rank"] == "1" and int(tick["step"]) >= args.warmup:
            gap = statistics.median(_gaps(ticks))
            time.sleep(rng.uniform(0.0, gap))  # a moment drawn inside the next step
            os.kill(victim(), signal.SIGKILL)
            killed_at = time.time()
    return ticks, killed_at


def samples_lost(ticks, ranks: int, steps: int, batch: int = 48, first: int = 1) -> int:
    """The samples of the run's global batches `first`..`steps` (1-based, of `batch` samples
    each, in the dataset's order) that no applied update held. Applied: the batch of every
    tick with done=1 (its rank's batch went into a committed update), and the whole global
    batch `at` of a step committed at full size (which also covers a rank killed after the
    step committed but before it printed its tick)."""
    applied: set[int] = set()
    for t in ticks:
        if t["done"] == "1":
            applied |= unspan(t["idx"])
            if int(t["world"]) == ranks:
                at = int(t["at"])
                applied |= set(range((at - 1) * batch, at * batch))
    wanted = set(range((first - 1) * batch, steps * batch))
    return len(wanted - applied)


def one_run(mode: str, args, rng) -> dict:
    ckpt = Path(tempfile.mkdtemp(prefix="keep-going-"))
    cmd = [sys.executable, "-m", "phalanx", "run", "-n", str(args.ranks), "--on-failure", mode,
           "--max-restarts", "1", str(HERE), "--worker", "--ckpt", str(ckpt),
           "--steps", str(args.steps), "--save-every", str(args.save_every),
           "--strategy", args.strategy]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ticks, killed_at = watch_and_kill(proc.stdout, args, rng, fields=9,
                                          victim=lambda: _worker_pid(ckpt, b"RANK=1"))
        proc.wait(timeout=600)
    finally:
        proc.kill()
        shutil.rmtree(ckpt, ignore_errors=True)  # its checkpoints: 0.3 GB
    stderr = proc.stderr.read()
    return {"mode": mode, **recovery(ticks, killed_at, args.ranks),
            "step_s": statistics.median(_gaps(ticks)),
            "samples_lost": samples_lost(ticks, args.ranks, args.steps),
            "ok": proc.returncode == 0, "stderr": stderr, "ticks": ticks, "killed_at": killed_at}


def recovery(ticks, killed_at: float, ranks: int) -> dict:
    """Seconds from the kill to the first step committed after it (went_on_s) and to the
    first committed at full size again (full_size_s), and the global steps trained twice
    (lost)."""
    # after the kill, a step on the group without the killed rank (continue), or by the
    # restarted workers (restart); then the first at full size again
    after = [t for t in ticks if float(t["t"]) > killed_at and t["done"] == "1"
             and (int(t["world"]) < ranks or t["restart"] != "0" or t["life"] != "0")]
    first = min(after, key=lambda t: float(t["t"]))
    full = [float(t["t"]) for t in ticks if float(t["t"]) >= float(first["t"])
            and t["done"] == "1" and int(t["world"]) == ranks]
    # the last global step the first group committed (after the kill too: a step whose vote
    # had passed), and the first one committed after it: what lies between was trained twice
    before = max(int(t["at"]) for t in ticks if t["done"] == "1" and t["restart"] == "0"
                 and int(t["world"]) == ranks and float(t["t"]) < float(first["t"]))
    return {"went_on_s": float(first["t"]) - killed_at,
            "full_size_s": (min(full) - killed_at) if full else float("nan"),
            "lost": before - (int(first["at"]) - 1)}


def _gaps(ticks) -> list[float]:
    mine = [float(t["t"]) for t in ticks if t["rank"] == "0"]
    return [b - a for a, b in zip(mine, mine[1:])] or [0.1]


def _worker_pid(token: Path, *env: bytes) -> int:
    """The worker process whose command line holds `token` and whose environment holds every
    `NAME=value` of `env` (a launcher's agent runs the same command line, without them)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(token) in cmd and "--worker" in cmd and all(e in environ for e in env):
            return int(pid)
    raise RuntimeError(f"no worker with {env} found")


def step_times(mode: str, args) -> list[float]:
    """Rank 0's steps after `args.warmup` steps, in a job with no failure and no save."""
    ckpt = Path(tempfile.mkdtemp(prefix="keep-going-"))
    cmd = [sys.executable, "-m", "phalanx", "run", "-n", str(args.ranks), "--on-failure",
           mode, str(HERE), "--worker", "--ckpt", str(ckpt), "--steps", str(args.steps),
           "--save-every", str(10**9), "--strategy", args.strategy]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False).stdout
    shutil.rmtree(ckpt, ignore_errors=True)
    ticks = [t for t in (parse_tick(line, 9) for line in out.splitlines()) if t]
    return _gaps(ticks[args.warmup * args.ranks:])


def overhead(args) -> None:
    """What continue mode costs a step with no failure (its vote: one all-reduce of one
    element per optimizer.step), against the same job under restart, alternating."""
    times = {"continue": [], "restart": []}
    for r in range(args.rounds):
        for mode in ("continue", "restart"):
            times[mode].append(statistics.median(step_times(mode, args)))
            print(f"round {r} {mode:8s} median step {times[mode][-1] * 1e3:.1f} ms", flush=True)
    a, b = statistics.median(times["continue"]), statistics.median(times["restart"])
    print(f"median step: continue {a * 1e3:.1f} ms, restart {b * 1e3:.1f} ms, ratio {a / b:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--ckpt")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--part", choices=("failure", "overhead"), default="failure")
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    rng = random.Random(0)
    if args.part == "overhead":
        return overhead(args)
    rows = []
    for r in range(args.rounds):
        for mode in ("continue", "restart"):
            row = one_run(mode, args, rng)
            rows.append(row)
            print(f"round {r} {mode:8s} went on after {row['went_on_s']:.2f} s, full size after "
                  f"{row['full_size_s']:.2f} s, steps trained again {row['lost']}, samples lost "
                  f"{row['samples_lost']}, step "
                  f"{row['step_s']:.3f} s, exit ok {row['ok']}", flush=True)
            if not row["ok"]:
                print(row["stderr"][-3000:])
    for mode in ("continue", "restart"):
        mine = [r for r in rows if r["mode"] == mode]
        print(f"median {mode:8s}: went on after "
              f"{statistics.median(r['went_on_s'] for r in mine):.2f} s, full size after "
              f"{statistics.median(r['full_size_s'] for r in mine):.2f} s, steps trained again "
              f"{statistics.median(r['lost'] for r in mine)}")


if __name__ == "__main__":
    main()
