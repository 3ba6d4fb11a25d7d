"""A fault soak: many short `phalanx run` jobs, each with one fault at a random moment, each
checked against its uninterrupted run and for what it leaves behind.

    .venv/bin/python benchmarks/fault_soak.py                        # 120 jobs, a seed drawn
    .venv/bin/python benchmarks/fault_soak.py --jobs 24 --seed 7
    .venv/bin/python benchmarks/fault_soak.py --seed 7 --only 13     # job 13 of seed 7 again

Each job is tests/launch_scripts/keep_going.py on 3 ranks (float64, 12 steps: 2 epochs of 6
global batches of 12 samples, a px.save after every step, the README's resume lines) under one
strategy (ddp, zero1, zero2, zero3) and one failure mode:

- continue: `--on-failure continue --max-restarts 1` (the others go on, one replacement);
- restart: `--on-failure restart --max-restarts 1` (every worker restarted once);
- stop: `--on-failure stop` (the job ends at the failure);

with one fault, on a rank and at a step drawn from the seed: a SIGKILL at a step's start, in
its px.save or from outside at a random moment of a step; a SIGSTOP (a frozen rank) at a
step's start or from outside at a random moment; an out-of-memory error in the forward or the
backward that ends the worker (uncaught) or that the loop catches. Job i runs strategy i mod 4
under mode i mod 3 (so any 12 consecutive jobs hold every pair), and the faults are dealt from
a shuffled deck (every 7 consecutive jobs hold every kind). PHALANX_HANG_AFTER=3, so a frozen
rank is reported after 3 s, and `px.init(timeout=60)`: under restart and stop the store the
hang report is made through is served by rank 0's worker (launch/rendezvous.py), so a frozen
rank 0 there is found by the collectives' timeout instead (60 s; the default is 600).

A job passes when it ends as its mode promises:
- it completes (exit status 0) with rank 0's weights within 1e-10 of the uninterrupted run in
  a world of one (of the run that skipped the faulty batch, for an exception caught, or
  uncaught under continue), the fault seen by the launcher (a failure gone through, a
  restart) or by the vote (a caught one);
- or, where it cannot complete (any fault but a caught one under stop; under continue, a
  sharded job that lost a rank before its first checkpoint, or in the save after its last
  step), it exits non-zero with one `phalanx run: error:` message, which under stop names the
  rank and how it failed (a frozen rank: that it hung) and under continue says why it cannot
  go on; never exit 0 with another result;
- and it leaves nothing behind (benchmarks/soak_leftovers.py): no process of the job once the
  launcher has exited, nothing in its TMPDIR, no save half done, no /dev/shm entry.

Recovery: seconds from the fault (its FAULT line, or the signal sent) to the first step
completed after it (restart: the first step of the restarted workers; else the first step past
the last one any rank had completed at the fault). Prints a line per job, the seed and the
command that replays a job, and a table; exits 1 when a job fails. A failed job's output is
kept (the path is printed).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_leftovers import MARKER, Watch, job_processes

HERE = Path(__file__).resolve()
SCRIPT = HERE.parent.parent / "tests" / "launch_scripts" / "keep_going.py"
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
MODES = ("continue", "restart", "stop")
# (kind, moment): kill, stop (SIGSTOP), raise (uncaught) or caught
FAULTS = (("kill", "step"), ("kill", "save"), ("kill", "random"), ("stop", "step"),
          ("stop", "random"), ("raise", "step"), ("caught", "step"))
NAMES = {("kill", "step"): "SIGKILL at a step's start", ("kill", "save"): "SIGKILL in px.save",
         ("kill", "random"): "SIGKILL, random moment", ("stop", "step"):
         "SIGSTOP at a step's start", ("stop", "random"): "SIGSTOP, random moment",
         ("raise", "step"): "exception, uncaught", ("caught", "step"): "exception, caught"}
RANKS, EPOCHS, STEPS_PER_EPOCH = 3, 2, 6
STEPS = EPOCHS * STEPS_PER_EPOCH
SLEEP = 0.2           # seconds each step sleeps after its update: room for a random moment
TOLERANCE = 1e-10
COLLECTIVES = 60      # px.init(timeout=...): what finds a frozen rank 0 under restart and stop
# what a job under continue says when it cannot go on (the module's docstring)
CANNOT_GO_ON = ("nowhere but in a checkpoint",
                "the model does not hold what the loop was served")


@dataclass
class Job:
    index: int
    strategy: str
    mode: str
    kind: str
    moment: str
    rank: int
    step: int     # the fault's step (from outside: the step after whose end it is drawn)
    part: str     # where an exception is raised: forward or backward
    delay: float  # from outside: the fraction of a step waited after that step's end

    def __str__(self) -> str:
        where = f" ({self.part})" if self.kind in ("raise", "caught") else ""
        return (f"job {self.index}: {self.strategy} {self.mode}, {NAMES[self.kind, self.moment]}"
                f"{where}, rank {self.rank}, step {self.step}")

    def expected(self) -> tuple[bool, int | None]:
        """(whether it completes, the step whose batch its result leaves out)."""
        if self.kind == "caught":
            return True, self.step
        if self.mode == "stop":
            return False, None
        if self.mode == "restart":
            return True, None
        sharded = self.strategy != "ddp"
        if sharded and self.moment != "random" and self.step == 0:
            return False, None  # no checkpoint yet holds the lost shard
        if sharded and self.moment == "save" and self.step == STEPS - 1:
            return False, None  # the last step lost, with no loop left to train it again
        return True, (self.step if self.kind == "raise" else None)

    def script_args(self) -> list[str]:
        at = f"{self.rank}@{self.step}"
        return {("kill", "step"): ["--kill", at], ("kill", "save"): ["--die-in-save", at],
                ("stop", "step"): ["--freeze", at], ("raise", "step"): ["--raise", at],
                ("caught", "step"): ["--raise", at, "--catch"]}.get(
            (self.kind, self.moment), []) + (["--raise-in", self.part]
                                             if self.kind in ("raise", "caught") else [])


def plan(seed: int, jobs: int) -> list[Job]:
    """The jobs of `seed`: the same list, job for job, for any `jobs` past its index."""
    rng = random.Random(seed)
    deck: list = []
    out = []
    for i in range(jobs):
        if not deck:
            deck = list(FAULTS)
            rng.shuffle(deck)
        kind, moment = deck.pop()
        strategy, mode = STRATEGIES[i % len(STRATEGIES)], MODES[i % len(MODES)]
        rank, part, delay = rng.randrange(RANKS), rng.choice(("forward", "backward")), rng.random()
        low = 2 if kind == "caught" and strategy == "zero3" else 0  # zero3's vote: step 2 on
        step = rng.randrange(1, STEPS - 2) if moment == "random" else rng.randrange(low, STEPS)
        out.append(Job(i, strategy, mode, kind, moment, rank, step, part, delay))
    return out


@dataclass
class Outcome:
    job: Job
    verdict: str           # exact, ended, wrong, unexpected
    detail: str
    seconds: float
    fault_seen: bool
    recovery: float | None = None
    leftovers: dict = field(default_factory=dict)
    stdout: str = ""
    stderr: str = ""


class References:
    """The uninterrupted run in a world of one (plain python), and the runs that skip one
    step's batch, each made once."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def get(self, skip: int | None):
        import torch

        if skip not in self.done:
            out = self.root / f"reference-{skip}.pt"
            env = {k: v for k, v in os.environ.items() if k not in
                   ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
            extra = [] if skip is None else ["--skip", str(skip)]
            subprocess.run([sys.executable, str(SCRIPT), str(out), str(self.root / f"ck-{skip}"),
                            *common_args(), *extra], check=True, env=env, timeout=600,
                           capture_output=True)
            self.done[skip] = torch.load(out)
        return self.done[skip]


def common_args() -> list[str]:
    return ["--samples", str(STEPS_PER_EPOCH * 12), "--epochs", str(EPOCHS), "--ticks"]


def _fields(line: str, tag: str) -> dict | None:
    found = re.search(rf"\b{tag} (.*)$", line)
    return dict(re.findall(r"(\w+)=(\S+)", found.group(1))) if found else None


class Output:
    """The job's stdout and stderr, read as they come; TICK and FAULT lines parsed."""

    def __init__(self, proc):
        self.out: list[str] = []
        self.err: list[str] = []
        self.ticks: list[dict] = []
        self.faults: list[dict] = []
        self.changed = threading.Condition()
        self.threads = [threading.Thread(target=self._read, args=(proc.stdout, self.out)),
                        threading.Thread(target=self._read, args=(proc.stderr, self.err))]
        for t in self.threads:
            t.start()

    def _read(self, stream, into: list) -> None:
        for line in stream:
            into.append(line)
            tick, fault = _fields(line, "TICK"), _fields(line, "FAULT")
            with self.changed:
                if tick and len(tick) == 7:  # a whole line
                    self.ticks.append({k: float(v) if k == "t" else int(v)
                                       for k, v in tick.items()})
                if fault and len(fault) == 4:
                    self.faults.append(fault)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for_tick(self, rank: int, step: int, proc, timeout: float) -> dict | None:
        """The first worker's TICK of `rank` at `step` or later, or None if none comes."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for t in self.ticks:
                    if t["rank"] == rank and t["life"] == 0 and t["attempt"] == 0 \
                            and t["step"] >= step:
                        return t
                left = deadline - time.monotonic()
                if left <= 0 or proc.poll() is not None:
                    return None
                self.changed.wait(min(left, 0.5))

    def join(self) -> None:
        for t in self.threads:
            t.join()


def step_seconds(ticks: list[dict]) -> float:
    mine = sorted(t["t"] for t in ticks if t["rank"] == 0 and t["attempt"] == 0)
    return statistics.median([b - a for a, b in zip(mine, mine[1:])] or [SLEEP])


def recovery(job: Job, ticks: list[dict], fault_t: float | None) -> float | None:
    """Seconds from the fault to the first step completed after it (the module's docstring)."""
    if fault_t is None or (job.mode == "stop" and job.kind != "caught"):
        return None
    if job.mode == "restart" and job.kind != "caught":
        after = [t["t"] for t in ticks if t["attempt"] > 0]
    else:
        done = max((t["step"] for t in ticks if t["t"] <= fault_t), default=-1)
        after = [t["t"] for t in ticks if t["t"] > fault_t and t["step"] > done]
    return min(after) - fault_t if after else None


def run_job(job: Job, root: Path, refs: References, timeout: float) -> Outcome:
    token = f"soak-{job.index}-{random.Random().getrandbits(48):012x}"
    where = root / token
    tmp, ckpt, out = where / "tmp", where / "ckpt", where / "out.pt"
    tmp.mkdir(parents=True)
    cmd = [sys.executable, "-m", "phalanx", "run", "-n", str(RANKS), "--on-failure", job.mode,
           *(["--max-restarts", "1"] if job.mode != "stop" else []), str(SCRIPT), str(out),
           str(ckpt), "--strategy", job.strategy, "--sleep", str(SLEEP),
           "--timeout", str(COLLECTIVES), *common_args(), *job.script_args()]
    env = dict(os.environ, TMPDIR=str(tmp), PHALANX_HANG_AFTER="3",
               PHALANX_RUN_DIR=str(where / "runs"), **{MARKER: token})
    watch = Watch(token)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    output = Output(proc)
    fault_t = None
    try:
        if job.moment == "random":
            fault_t = _from_outside(job, proc, output, timeout)
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        for pid in job_processes(token, watch.groups):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    seconds = time.monotonic() - start
    output.join()
    leftovers = watch.leftovers(tmp, ckpt)
    stdout, stderr = "".join(output.out), "".join(output.err)
    if job.moment != "random" and output.faults:
        fault_t = float(output.faults[0]["t"])
    outcome = Outcome(job, "", "", seconds, fault_t is not None,
                      recovery(job, output.ticks, fault_t),
                      {k: v for k, v in leftovers.items() if v}, stdout, stderr)
    outcome.verdict, outcome.detail = ("unexpected", f"still running after {timeout:.0f} s") \
        if timed_out else judge(job, proc.returncode, out, stderr, fault_t is not None, refs)
    return outcome


def _from_outside(job: Job, proc, output: Output, timeout: float) -> float | None:
    """SIGKILL or SIGSTOP the first worker of `job.rank` a drawn fraction of a step after its
    step `job.step` ended; the time sent, or None when it ended before."""
    tick = output.wait_for_tick(job.rank, job.step, proc, timeout)
    if tick is None:
        return None
    time.sleep(job.delay * step_seconds(output.ticks))
    try:
        os.kill(tick["pid"], signal.SIGKILL if job.kind == "kill" else signal.SIGSTOP)
    except ProcessLookupError:
        return None
    return time.time()


def judge(job: Job, code: int, out: Path, stderr: str, fault_seen: bool,
          refs: References) -> tuple[str, str]:
    """(verdict, what was seen): see the module's docstring."""
    import torch

    completes, skip = job.expected()
    errors = re.findall(r"^phalanx run: error: .*$", stderr, re.M)
    if code == 0:
        if not out.exists():
            return "wrong", "exit status 0 and no weights written"
        diff = (torch.load(out) - refs.get(skip)).abs().max().item()
        if not diff < TOLERANCE:
            return "wrong", f"exit status 0, weights {diff:.3g} from the reference"
        if not completes:
            return "unexpected", f"completed ({diff:.1e}), though it should not have"
        if not fault_seen:
            return "unexpected", "completed, but the fault never landed"
        said = {"continue": "going on through 1 failure", "restart": "restarting workers"}
        if job.kind == "caught":
            seen = f"rank {job.rank} raised" in stderr
        else:
            seen = said[job.mode] in stderr
        if not seen:
            return "unexpected", f"completed ({diff:.1e}), but the launcher never saw the fault"
        return "exact", f"completed, {diff:.1e} from the reference"
    if len(errors) != 1 or "the job completed" in stderr:
        return "unexpected", f"exit status {code} with {len(errors)} error messages"
    message = errors[0]
    how = {"kill": "killed by SIGKILL", "stop": "hung", "raise": "CUDA out of memory"}
    if job.mode == "stop" and not completes and \
            message.startswith(f"phalanx run: error: rank {job.rank} ") and \
            how[job.kind] in message:
        return "ended", message
    if job.mode == "continue" and (not completes or job.moment == "random") and \
            any(reason in stderr for reason in CANNOT_GO_ON):
        return "ended", message
    return "unexpected", f"exit status {code}: {message}"


def table(outcomes: list[Outcome]) -> str:
    """Faults by kind and strategy with the slowest recovery, then verdicts by mode."""
    rows = [f"{'fault':27s}" + "".join(f"{s:>7s}" for s in STRATEGIES) +
            f"{'all':>6s}  slowest recovery"]
    for fault in FAULTS:
        mine = [o for o in outcomes if (o.job.kind, o.job.moment) == fault and o.fault_seen]
        slowest = max((o.recovery for o in mine if o.recovery is not None), default=None)
        rows.append(f"{NAMES[fault]:27s}" + "".join(
            f"{sum(o.job.strategy == s for o in mine):7d}" for s in STRATEGIES) +
            f"{len(mine):6d}  " + ("-" if slowest is None else f"{slowest:.2f} s"))
    seen = [o for o in outcomes if o.fault_seen]
    rows.append(f"{'all':27s}" + "".join(f"{sum(o.job.strategy == s for o in seen):7d}"
                                         for s in STRATEGIES) + f"{len(seen):6d}")
    rows.append("")
    rows.append(f"{'mode':10s}{'jobs':>6s}{'completed, equal':>18s}{'ended, one message':>20s}"
                f"{'wrong results':>15s}{'unexpected':>12s}{'leftovers':>11s}")
    for mode in (*MODES, "all"):
        mine = [o for o in outcomes if mode in (o.job.mode, "all")]
        count = {v: sum(o.verdict == v for o in mine) for v in ("exact", "ended", "wrong",
                                                               "unexpected")}
        rows.append(f"{mode:10s}{len(mine):6d}{count['exact']:18d}{count['ended']:20d}"
                    f"{count['wrong']:15d}{count['unexpected']:12d}"
                    f"{sum(bool(o.leftovers) for o in mine):11d}")
    kinds = {k: sum(len(o.leftovers.get(k, [])) for o in outcomes)
             for k in ("processes", "temporary", "shared memory")}
    rows.append("leftovers: " + ", ".join(f"{k} {n}" for k, n in kinds.items()))
    timed = [o for o in outcomes if o.recovery is not None]
    if timed:
        worst = max(timed, key=lambda o: o.recovery)
        rows.append(f"slowest recovery: {worst.recovery:.2f} s ({worst.job})")
    return "\n".join(rows)


def soak(seed: int, jobs: list[Job], root: Path, timeout: float = 240.0,
         say=print) -> list[Outcome]:
    """Run `jobs` one after another; failed jobs' output is kept under `root`/failed."""
    refs = References(root)
    outcomes = []
    for job in jobs:
        outcome = run_job(job, root, refs, timeout)
        outcomes.append(outcome)
        rec = "" if outcome.recovery is None else f", recovery {outcome.recovery:.2f} s"
        left = f"; LEFT {outcome.leftovers}" if outcome.leftovers else ""
        say(f"{job}: {outcome.verdict}: {outcome.detail}{rec} [{outcome.seconds:.1f} s]{left}",
            flush=True)
        if outcome.verdict not in ("exact", "ended") or outcome.leftovers:
            kept = root / "failed" / f"job{job.index}"
            kept.mkdir(parents=True, exist_ok=True)
            (kept / "stdout").write_text(outcome.stdout)
            (kept / "stderr").write_text(outcome.stderr)
            say(f"  its output: {kept}; again: {replay(seed, job.index)}", flush=True)
    return outcomes


def replay(seed: int, index: int) -> str:
    return f"{sys.executable} {HERE} --seed {seed} --only {index}"


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(HERE.parent.parent), "status", "--porcelain",
                            "--", "src"], capture_output=True, text=True).stdout.strip()
    return (f"{cpu}, {os.cpu_count()} cores; commit {commit or '?'}"
            f"{' (src/ with uncommitted changes)' if dirty else ''}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=120)
    parser.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    parser.add_argument("--only", default=None, help="job numbers, comma-separated")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a job may take")
    parser.add_argument("--keep", action="store_true", help="keep every job's directory")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    only = [int(i) for i in args.only.split(",")] if args.only else None
    jobs = plan(seed, max([args.jobs, *(i + 1 for i in only or [])]))
    jobs = [jobs[i] for i in only] if only else jobs
    root = Path(tempfile.mkdtemp(prefix="fault-soak-"))
    print(f"fault soak: seed {seed}, {len(jobs)} jobs of {RANKS} ranks x {STEPS} steps; "
          f"{machine()}\n  {' '.join([sys.executable, *sys.argv])}\n  work in {root}",
          flush=True)
    start = time.monotonic()
    outcomes = soak(seed, jobs, root, args.timeout)
    print(f"\nseed {seed}, {len(outcomes)} jobs in {(time.monotonic() - start) / 60:.1f} min; "
          f"{machine()}")
    print(table(outcomes))
    bad = [o for o in outcomes if o.verdict not in ("exact", "ended") or o.leftovers]
    if not args.keep:
        for entry in root.iterdir():
            if entry.name != "failed":
                shutil.rmtree(entry, ignore_errors=True)
        if not bad:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
