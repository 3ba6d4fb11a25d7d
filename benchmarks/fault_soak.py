"""A fault soak: many short `phalanx run` jobs, each with one fault at a random moment, each
checked against its uninterrupted run and for what it leaves behind.

    .venv/bin/python benchmarks/fault_soak.py                        # 132 jobs, a seed drawn
    .venv/bin/python benchmarks/fault_soak.py --jobs 33 --seed 7
    .venv/bin/python benchmarks/fault_soak.py --seed 7 --only 13     # job 13 of seed 7 again

Each job is tests/launch_scripts/keep_going.py on 3 ranks (float64, 12 steps: 2 epochs of 6
global batches of 12 samples, a px.save after every step, the README's resume lines) under one
strategy (ddp, zero1, zero2, zero3) and one failure mode:

- continue: `--on-failure continue --max-restarts 1` (the others go on, one replacement);
- restart: `--on-failure restart --max-restarts 1` (every worker restarted once);
- stop: `--on-failure stop` (the job ends at the failure);

with every parameter trained or one of the model's three Linear layers frozen (requires_grad
off before px.prepare: `--frozen-layers`, the layer drawn from the seed), and with one fault,
on a rank and at a step drawn from the seed:

- a SIGKILL at a step's start, in its px.save, from outside at a random moment of a step, or in
  an evaluation (`--eval-every 3`: forwards under no_grad over 30 samples in 5 batches, each
  gathered with px.gather_for_metrics, after steps 3, 6, 9 and 12; the kill before a batch
  drawn from the seed);
- a SIGSTOP (a frozen rank) at a step's start or from outside at a random moment, of a rank
  drawn from the seed, or from outside at a random moment of rank 0 (the rank whose worker
  serves the job's store under restart and stop);
- an out-of-memory error in the forward or the backward that ends the worker (uncaught) or that
  the loop catches;
- an out-of-memory error inside optimizer.step() (a step pre-hook), uncaught or caught (caught,
  the rank meets StepFailed at its next call into its model, which ends it).

Job i runs strategy i mod 4 under mode i mod 3 (so any 12 consecutive jobs hold every pair),
with a layer frozen when i // 4 is odd (so any 8 consecutive jobs hold every strategy both
ways, and any 24 every strategy, mode and frozen-or-not), and the faults are dealt from a deck
of the 11 kinds, shuffled afresh for each 11 jobs: jobs 0-10, 11-21, ... each hold every kind
once, so any 21 consecutive jobs hold every kind. PHALANX_HANG_AFTER=3, so a frozen rank is
reported after 3 s (rank 0 too: the hang watcher asks the store rank 0's worker serves with a
bound of its own, faults/store_calls.py), and `px.init(timeout=60)` (the default is 600).

A job passes when it ends as its mode promises (docs/guides/failures.md, "What each mode
survives"):
- it completes (exit status 0) with rank 0's weights within 1e-10 of the uninterrupted run in
  a world of one with the same layer frozen (of the run that skipped the faulty batch, for an
  exception in a forward or backward caught, or uncaught under continue; an exception inside
  optimizer.step() is past the step's vote, so the others keep that step and redo the ones
  after it: the uninterrupted run), every evaluation any worker printed holding the 30 samples
  with the uninterrupted run's loss sum (within 1e-10), every survivor under continue having
  made every evaluation and under restart the restarted workers every one after the kill, and
  the fault seen by the launcher (a failure gone through, a restart) or by the vote (an
  exception in a forward or backward, caught);
- or, where it cannot complete (any fault but an exception caught in a forward or backward
  under stop; under continue, a sharded job that lost a rank before its first checkpoint, or
  in the save after its last step, where an exception inside optimizer.step() is seen too),
  it exits non-zero with one `phalanx run: error:` message, which under stop names the rank and
  how it failed (a frozen rank, rank 0 too: that it hung) and under continue says why it
  cannot go on; never exit 0 with another result;
- and it leaves nothing behind (benchmarks/soak_leftovers.py): no process of the job once the
  launcher has exited, nothing in its TMPDIR, no save half done, no /dev/shm entry.

Recovery: seconds from the fault (its FAULT line, or the signal sent) to the first step
completed after it (restart: the first step of the restarted workers; a kill in an evaluation
under continue: the first survivor's line for that evaluation, timed as read; else the first
step past the last one any rank had completed at the fault, and past the fault's own step for
an exception inside optimizer.step(), which the others complete); none for a job that ended.
Prints a line per job, the seed and the command that replays a job, and a table; exits 1 when
a job fails. A failed job's output is kept (the path is printed).
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
# (kind, moment): kill, stop (SIGSTOP), raise (uncaught) or caught; the moment "random" is
# from outside, of a rank drawn, and "rank0" from outside at a random moment, of rank 0
FAULTS = (("kill", "step"), ("kill", "save"), ("kill", "random"), ("kill", "eval"),
          ("stop", "step"), ("stop", "random"), ("stop", "rank0"), ("raise", "step"),
          ("caught", "step"), ("raise", "optimizer"), ("caught", "optimizer"))
NAMES = {("kill", "step"): "SIGKILL at a step's start", ("kill", "save"): "SIGKILL in px.save",
         ("kill", "random"): "SIGKILL, random moment", ("kill", "eval"):
         "SIGKILL in an evaluation", ("stop", "step"): "SIGSTOP at a step's start",
         ("stop", "random"): "SIGSTOP, random moment", ("stop", "rank0"):
         "SIGSTOP of rank 0, random moment", ("raise", "step"): "exception, uncaught",
         ("caught", "step"): "exception, caught", ("raise", "optimizer"):
         "exception in step(), uncaught", ("caught", "optimizer"): "exception in step(), caught"}
OUTSIDE = ("random", "rank0")  # the moments sent from outside
RANKS, EPOCHS, STEPS_PER_EPOCH = 3, 2, 6
STEPS = EPOCHS * STEPS_PER_EPOCH
EVAL_EVERY, EVAL_BATCHES = 3, 5  # keep_going.py's evaluation set: 30 samples, 6 a batch
LAYERS = ("a", "b", "c")         # keep_going.py's Net: one of them frozen in half the jobs
SLEEP = 0.2           # seconds each step sleeps after its update: room for a random moment
TOLERANCE = 1e-10
COLLECTIVES = 60      # px.init(timeout=...)
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
    step: int     # the fault's step (from outside: the step after whose end it is drawn; in an
    #               evaluation: the step after which it evaluates, as phalanx counts steps)
    part: str     # where an exception is raised: forward or backward (or step: in step())
    delay: float  # from outside: the fraction of a step waited after that step's end
    batch: int = 0     # in an evaluation: the batch before whose forward the rank is killed
    frozen: str = ""   # the layer of keep_going.py's Net frozen, or "" for none

    def __str__(self) -> str:
        where = f" ({self.part})" if (self.kind in ("raise", "caught")
                                      and self.moment == "step") else ""
        if self.moment == "eval":
            where = f" (batch {self.batch})"
        frozen = f", layer {self.frozen} frozen" if self.frozen else ""
        return (f"job {self.index}: {self.strategy} {self.mode}{frozen}, "
                f"{NAMES[self.kind, self.moment]}{where}, rank {self.rank}, step {self.step}")

    def expected(self) -> tuple[bool, int | None]:
        """(whether it completes, the step whose batch its result leaves out)."""
        if self.dropped:
            return True, self.step  # the step is dropped on every rank, nobody leaves
        if self.mode == "stop":
            return False, None
        if self.mode == "restart":
            return True, None
        sharded = self.strategy != "ddp"
        # an exception inside optimizer.step() ends the rank past the step's vote: the others
        # keep that step and first meet the loss in its px.save, as after a kill there
        in_save = self.moment in ("save", "optimizer")
        if sharded and self.moment not in OUTSIDE and self.step == 0:
            return False, None  # no checkpoint yet holds the lost shard
        if sharded and in_save and self.step == STEPS - 1:
            return False, None  # the last step lost, with no loop left to train it again
        return True, (self.step if (self.kind, self.moment) == ("raise", "step") else None)

    @property
    def dropped(self) -> bool:
        """An exception caught in a forward or backward: the step is dropped, nobody leaves."""
        return (self.kind, self.moment) == ("caught", "step")

    def extra_args(self) -> list[str]:
        """What the job and its reference run with beyond `common_args()`."""
        return ((["--frozen-layers", self.frozen] if self.frozen else []) +
                (["--eval-every", str(EVAL_EVERY)] if self.moment == "eval" else []))

    def script_args(self) -> list[str]:
        at = f"{self.rank}@{self.step}"
        return {("kill", "step"): ["--kill", at], ("kill", "save"): ["--die-in-save", at],
                ("kill", "eval"): ["--kill-in-eval", f"{self.rank}@{self.step + 1}@{self.batch}"],
                ("stop", "step"): ["--freeze", at], ("raise", "step"): ["--raise", at],
                ("caught", "step"): ["--raise", at, "--catch"],
                ("raise", "optimizer"): ["--raise", at],
                ("caught", "optimizer"): ["--raise", at, "--catch"]}.get(
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
        batch, layer = rng.randrange(EVAL_BATCHES), rng.choice(LAYERS)
        frozen = layer if (i // len(STRATEGIES)) % 2 else ""
        if moment == "rank0":
            rank = 0
        if moment == "optimizer":
            part = "step"  # keep_going.py's --raise-in step: in a step pre-hook
        low = 2 if (kind, moment) == ("caught", "step") and strategy == "zero3" else 0  # its vote
        if moment in OUTSIDE:
            step = rng.randrange(1, STEPS - 2)
        elif moment == "eval":  # the evaluation after step S (S + 1 steps taken)
            step = rng.randrange(EVAL_EVERY, STEPS + 1, EVAL_EVERY) - 1
        else:
            step = rng.randrange(low, STEPS)
        out.append(Job(i, strategy, mode, kind, moment, rank, step, part, delay, batch, frozen))
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
    step's batch, each made once per frozen layer and evaluation: (weights, its evaluations)."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def get(self, skip: int | None, extra: list[str]) -> tuple:
        import torch

        key = (skip, *extra)
        if key not in self.done:
            name = "-".join(map(str, key)).replace("--", "")
            out = self.root / f"reference-{name}.pt"
            env = {k: v for k, v in os.environ.items() if k not in
                   ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
            skipping = [] if skip is None else ["--skip", str(skip)]
            done = subprocess.run([sys.executable, str(SCRIPT), str(out),
                                   str(self.root / f"ck-{name}"), *common_args(), *extra,
                                   *skipping], check=True, env=env, timeout=600,
                                  capture_output=True, text=True)
            evals = {int(e["step"]): (int(e["n"]), float(e["sum"])) for e in
                     filter(None, (_fields(line, "EVAL") for line in done.stdout.splitlines()))}
            self.done[key] = (torch.load(out), evals)
        return self.done[key]


def common_args() -> list[str]:
    return ["--samples", str(STEPS_PER_EPOCH * 12), "--epochs", str(EPOCHS), "--ticks"]


def _fields(line: str, tag: str) -> dict | None:
    found = re.search(rf"\b{tag} (.*)$", line)
    return dict(re.findall(r"(\w+)=(\S+)", found.group(1))) if found else None


class Output:
    """The job's stdout and stderr, read as they come; TICK, FAULT and EVAL lines parsed (an
    EVAL line carries no time: `t` is when it was read)."""

    def __init__(self, proc):
        self.out: list[str] = []
        self.err: list[str] = []
        self.ticks: list[dict] = []
        self.faults: list[dict] = []
        self.evals: list[dict] = []
        self.changed = threading.Condition()
        self.threads = [threading.Thread(target=self._read, args=(proc.stdout, self.out)),
                        threading.Thread(target=self._read, args=(proc.stderr, self.err))]
        for t in self.threads:
            t.start()

    def _read(self, stream, into: list) -> None:
        for line in stream:
            into.append(line)
            tick, fault, evaluated = (_fields(line, tag) for tag in ("TICK", "FAULT", "EVAL"))
            with self.changed:
                if tick and len(tick) == 7:  # a whole line
                    self.ticks.append({k: float(v) if k == "t" else int(v)
                                       for k, v in tick.items()})
                if fault and len(fault) == 4:
                    self.faults.append(fault)
                if evaluated and len(evaluated) == 5:
                    self.evals.append({"rank": int(evaluated["rank"]),
                                       "life": int(evaluated["life"]),
                                       "step": int(evaluated["step"]), "n": int(evaluated["n"]),
                                       "sum": float(evaluated["sum"]), "t": time.time()})
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


def recovery(job: Job, output: Output, fault_t: float | None) -> float | None:
    """Seconds from the fault to the first step completed after it (the module's docstring)."""
    ticks = output.ticks
    if fault_t is None or (job.mode == "stop" and not job.dropped):
        return None
    if job.mode == "restart" and not job.dropped:
        after = [t["t"] for t in ticks if t["attempt"] > 0]
    elif job.moment == "eval":  # the evaluation the rank was lost in, made by a survivor
        after = [e["t"] for e in output.evals if e["step"] == job.step + 1 and e["t"] > fault_t]
    else:  # inside optimizer.step(), the others complete the fault's step: the one after it
        done = max([t["step"] for t in ticks if t["t"] <= fault_t] +
                   [job.step if job.moment == "optimizer" else -1])
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
           "--timeout", str(COLLECTIVES), *common_args(), *job.extra_args(), *job.script_args()]
    env = dict(os.environ, TMPDIR=str(tmp), PHALANX_HANG_AFTER="3",
               PHALANX_RUN_DIR=str(where / "runs"), **{MARKER: token})
    watch = Watch(token)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    output = Output(proc)
    fault_t = None
    try:
        if job.moment in OUTSIDE:
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
    if job.moment not in OUTSIDE and output.faults:
        fault_t = float(output.faults[0]["t"])
    outcome = Outcome(job, "", "", seconds, fault_t is not None,
                      recovery(job, output, fault_t),
                      {k: v for k, v in leftovers.items() if v}, stdout, stderr)
    outcome.verdict, outcome.detail = ("unexpected", f"still running after {timeout:.0f} s") \
        if timed_out else judge(job, proc.returncode, out, stderr, fault_t is not None, refs,
                                output.evals)
    if outcome.verdict == "ended":  # nothing was recovered
        outcome.recovery = None
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


def evaluated_wrongly(job: Job, evals: list[dict], expected: dict) -> str | None:
    """What is wrong with the evaluations of a job that completed, or None: every one holds
    the 30 samples with the reference's loss sum; under continue every survivor made every
    one, under restart every rank every one after the kill (its restarted workers)."""
    for e in evals:
        want = expected.get(e["step"])
        if want is None or e["n"] != want[0] or not abs(e["sum"] - want[1]) < TOLERANCE:
            return (f"rank {e['rank']} (life {e['life']}) evaluated after {e['step']} steps: "
                    f"{e['n']} samples, loss sum {e['sum']!r}; the reference: {want}")
    if job.moment != "eval":
        return None
    if sorted(expected) != list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)):
        return f"the reference evaluated after {sorted(expected)} steps"
    lost = job.step + 1  # the evaluation the rank was killed in, by the steps taken
    for rank in range(RANKS):
        made = sorted(e["step"] for e in evals if e["rank"] == rank and e["life"] == 0)
        if job.mode == "continue" and rank != job.rank and made != sorted(expected):
            return f"rank {rank} made the evaluations after {made} steps, not {sorted(expected)}"
        if job.mode == "restart" and not {s for s in expected if s > lost} <= set(made):
            return f"rank {rank} made the evaluations after {made} steps, restarted"
    return None


def judge(job: Job, code: int, out: Path, stderr: str, fault_seen: bool,
          refs: References, evals: list[dict] = ()) -> tuple[str, str]:
    """(verdict, what was seen): see the module's docstring."""
    import torch

    completes, skip = job.expected()
    errors = re.findall(r"^phalanx run: error: .*$", stderr, re.M)
    if code == 0:
        if not out.exists():
            return "wrong", "exit status 0 and no weights written"
        weights, expected = refs.get(skip, job.extra_args())
        diff = (torch.load(out) - weights).abs().max().item()
        if not diff < TOLERANCE:
            return "wrong", f"exit status 0, weights {diff:.3g} from the reference"
        wrong = evaluated_wrongly(job, list(evals), expected)
        if wrong:
            return "wrong", f"exit status 0, weights {diff:.1e} from the reference; {wrong}"
        if not completes:
            return "unexpected", f"completed ({diff:.1e}), though it should not have"
        if not fault_seen:
            return "unexpected", "completed, but the fault never landed"
        said = {"continue": "going on through 1 failure", "restart": "restarting workers"}
        if job.dropped:
            seen = f"rank {job.rank} raised" in stderr
        else:
            seen = said[job.mode] in stderr
        if not seen:
            return "unexpected", f"completed ({diff:.1e}), but the launcher never saw the fault"
        return "exact", f"completed, {diff:.1e} from the reference"
    if len(errors) != 1 or "the job completed" in stderr:
        return "unexpected", f"exit status {code} with {len(errors)} error messages"
    message = errors[0]
    how = {"kill": "killed by SIGKILL", "stop": "hung", "raise": "CUDA out of memory",
           "caught": "CUDA out of memory"}
    if job.mode == "stop" and not completes and \
            message.startswith(f"phalanx run: error: rank {job.rank} ") and \
            how[job.kind] in message:
        return "ended", message
    if job.mode == "continue" and (not completes or job.moment in OUTSIDE) and \
            any(reason in stderr for reason in CANNOT_GO_ON):
        return "ended", message
    return "unexpected", f"exit status {code}: {message}"


def table(outcomes: list[Outcome]) -> str:
    """Faults by kind and strategy with the slowest recovery, then verdicts by mode (and of the
    jobs with a layer frozen)."""
    width = max(map(len, NAMES.values())) + 2
    rows = [f"{'fault':{width}s}" + "".join(f"{s:>7s}" for s in STRATEGIES) +
            f"{'all':>6s}  slowest recovery"]
    for fault in FAULTS:
        mine = [o for o in outcomes if (o.job.kind, o.job.moment) == fault and o.fault_seen]
        slowest = max((o.recovery for o in mine if o.recovery is not None), default=None)
        rows.append(f"{NAMES[fault]:{width}s}" + "".join(
            f"{sum(o.job.strategy == s for o in mine):7d}" for s in STRATEGIES) +
            f"{len(mine):6d}  " + ("-" if slowest is None else f"{slowest:.2f} s"))
    seen = [o for o in outcomes if o.fault_seen]
    rows.append(f"{'all':{width}s}" + "".join(f"{sum(o.job.strategy == s for o in seen):7d}"
                                              for s in STRATEGIES) + f"{len(seen):6d}")
    rows.append("")
    rows.append(f"{'mode':10s}{'jobs':>6s}{'completed, equal':>18s}{'ended, one message':>20s}"
                f"{'wrong results':>15s}{'unexpected':>12s}{'leftovers':>11s}")
    for mode in (*MODES, "all", "frozen"):
        mine = [o for o in outcomes if mode in (o.job.mode, "all") or
                (mode == "frozen" and o.job.frozen)]
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
    parser.add_argument("--jobs", type=int, default=132)
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
