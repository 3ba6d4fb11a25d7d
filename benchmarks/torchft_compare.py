"""Recovering from a failure: phalanx `--on-failure continue` against torchft, in one run.

    .venv/bin/pip install torchft        # not a dependency of phalanx (0.2.0 was measured)
    .venv/bin/python benchmarks/torchft_compare.py                  # both parts, 3 rounds each
    .venv/bin/python benchmarks/torchft_compare.py --part failure --rounds 5
    .venv/bin/python benchmarks/torchft_compare.py --part overhead

Both train the 12.6M-parameter MLP of benchmarks/ddp.py (fp32, AdamW, lr 1e-4, loss
`model(x).pow(2).mean()`) on 3 CPU processes with gloo, one thread each, a global batch of 48
samples per step (16 per process) taken in the dataset's order, for `--steps` steps:

- phalanx: `phalanx run -n 3 --on-failure continue --max-restarts 1`, the job of
  benchmarks/keep_going.py (its worker and its measurement, imported from there): one job of
  3 ranks, a `px.save` every 10 steps, at which a replacement joins.
- torchft: a lighthouse (`torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100
  --join_timeout_ms 10000`, the settings of torchft's README; heartbeat timeout its default
  5000 ms, and 1000 ms in a second row) and 3 replica groups of one process each, each its own
  `torchrun --standalone --nproc_per_node 1 --max-restarts 1` (torchrun starts the killed
  process again, as phalanx's agent starts a replacement), with torchft's `Manager`
  (`min_replica_size=1`, `ProcessGroupGloo(timeout=5 s)`, `PGTransport` for the live recovery
  from a peer), `DistributedDataParallel` and `Optimizer` wrapper, as torchft's train_ddp.py.
  Replica group g trains on samples 48 s + 16 g ... 48 s + 16 g + 15 at the manager's step s,
  so a step that did not commit is trained again by those present.

`--part failure`: in each round both jobs run, one after the other (the order alternating), and
the process of rank 1 (replica group 1) is SIGKILLed once it has done `--warmup` steps, at a
moment drawn inside the next step (keep_going.watch_and_kill). Every process prints a line per
step: its step, whether its batch went into an applied update, how many processes the update
averaged, the time, and the sample indices its batch held. Measured:

- went on: seconds from the kill to the first step committed without the killed process
  (phalanx: the survivors' redo of the step in flight; torchft: the first step of the quorum
  formed without replica group 1);
- full size: seconds from the kill to the first step committed by 3 processes again;
- samples lost: of the `--steps` x 48 samples the run offered, those that never went into an
  applied update (keep_going.samples_lost, one rule for both).

`--part overhead`: no failure, the same jobs with no `px.save`, in a rotating order each round:
phalanx under `--on-failure continue` and `--on-failure restart` (its own path without the
per-step vote), torchft, and `torch.nn.parallel.DistributedDataParallel` under
`torchrun --nproc_per_node 3` (torchft's own path without its manager); the median step of
rank 0 after `--warmup` steps.

Prints one row per job and the medians over rounds, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import keep_going  # benchmarks/ is not a package: imported from its folder

HERE = Path(__file__).resolve()

BATCH, FIELDS = 48, 9  # the global batch; the fields of a TICK line
LIGHTHOUSE = ("import sys, time; from torchft._torchft import LighthouseServer; "
              "server = LighthouseServer(bind=sys.argv[1], min_replicas=1, join_timeout_ms=10000, "
              "quorum_tick_ms=100, heartbeat_timeout_ms=int(sys.argv[2])); time.sleep(1e6)")


def _data(steps: int):
    """The dataset of keep_going's worker: `steps` global batches of 512 features."""
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(steps * BATCH, 512, generator=g)


def _tick(rank, life, step, done, at, world, index) -> None:
    print(f"TICK rank={rank} life={life} restart={life} step={step} done={int(done)} at={at} "
          f"world={world} t={time.time():.4f} idx={keep_going.spans(index)}", flush=True)


def torchft_worker(args) -> None:
    """One replica group of one process, as torchft's train_ddp.py builds it."""
    import torch
    from ddp import make
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    torch.set_num_threads(1)
    group = int(os.environ["REPLICA_GROUP_ID"])
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    data, per_group = _data(args.steps), BATCH // args.ranks
    model = make("mlp")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"compare_{group}", timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10),
                                         device=torch.device("cpu")))
    ddp_model = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    while manager.current_step() < args.steps:
        s = manager.current_step()
        optimizer.zero_grad()  # starts the quorum for this step
        lo = s * BATCH + group * per_group
        ddp_model(data[lo:lo + per_group]).pow(2).mean().backward()
        optimizer.step()  # steps the optimizer only if every replica group's step committed
        # a group that is healing this step takes part with zeros: its batch is not in it
        done = manager.current_step() > s and manager.is_participating()
        _tick(group, life, manager.current_step(), done, s + 1, manager.num_participants(),
              range(lo, lo + per_group))
    manager.shutdown(wait=False)


def ddp_worker(args) -> None:
    """torch DDP on the same model and batches: torchft's path without its manager."""
    import torch
    import torch.distributed as dist
    from ddp import make

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, per_rank = dist.get_rank(), BATCH // args.ranks
    data = _data(args.steps)
    model = torch.nn.parallel.DistributedDataParallel(make("mlp"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for s in range(args.steps):
        lo = s * BATCH + rank * per_rank
        model(data[lo:lo + per_rank]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        _tick(rank, 0, s + 1, True, s + 1, args.ranks, range(lo, lo + per_rank))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, restarts: int, worker: str, token: Path, args, env: dict):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", str(nproc), "--max-restarts", str(restarts), str(HERE),
           "--worker", worker, "--ckpt", str(token), "--steps", str(args.steps),
           "--ranks", str(args.ranks)]
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", **env}


def _install_env(install: str) -> dict:
    """The environment that makes Python import torchft from `install` ("venv": the one
    installed in this interpreter's environment; else a `pip install --target` folder)."""
    if install == "venv":
        return {}
    return {"PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(install).resolve()), os.environ.get("PYTHONPATH")]))}


def torchft_version(install: str) -> str:
    code = ("import importlib.metadata as m; "
            "print(m.version(m.packages_distributions()['torchft'][0]))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, **_install_env(install)}).stdout.strip()


def torchft_job(args, rng, install: str, heartbeat_ms: int, kill: bool):
    """Run the torchft job of `install` (with one kill or none): (ticks, time of the kill,
    exit codes). The lighthouse runs in a Python process of the same installation, with the
    settings of torchft's README (`--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms
    10000`) and a heartbeat timeout of `heartbeat_ms`."""
    token = Path(tempfile.mkdtemp(prefix="torchft-compare-"))
    port = _free_port()
    with open(token / "lighthouse.log", "w") as log:
        lighthouse = subprocess.Popen(
            [sys.executable, "-c", LIGHTHOUSE, f"[::]:{port}", str(heartbeat_ms)],
            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
            env={**os.environ, **_install_env(install)})
    read, write = os.pipe()  # every group's stdout, one stream
    groups = []
    for g in range(args.ranks):
        cmd, env = _torchrun(1, 1 if kill else 0, "torchft", token, args, {
            **_install_env(install), "REPLICA_GROUP_ID": str(g),
            "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"})
        with open(token / f"group{g}.log", "w") as log:
            groups.append(subprocess.Popen(cmd, env=env, stdout=write, stderr=log,
                                           start_new_session=True))
    os.close(write)
    try:
        with os.fdopen(read) as stream:
            if kill:
                def victim():
                    return keep_going._worker_pid(token, b"REPLICA_GROUP_ID=1", b"RANK=0")
                ticks, killed_at = keep_going.watch_and_kill(stream, args, rng, victim, FIELDS)
            else:
                ticks = [t for t in (keep_going.parse_tick(line, FIELDS) for line in stream) if t]
                killed_at = None
        codes = [p.wait(timeout=600) for p in groups]
    finally:
        for p in [*groups, lighthouse]:  # the sessions started here
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        _end_workers(token)  # torchrun starts its workers in sessions of their own
    if any(codes):
        for g in range(args.ranks):
            print(f"group {g} exited {codes[g]}:\n" + (token / f"group{g}.log").read_text()[-3000:])
    shutil.rmtree(token, ignore_errors=True)
    return ticks, killed_at, codes


def _end_workers(token: Path) -> None:
    """SIGKILL what is left of the workers whose command line names `token` (this job's)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(token).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def failure(args) -> None:
    rng = random.Random(0)
    # name: None for phalanx, else (torchft installation, heartbeat timeout in ms)
    jobs = {"phalanx continue": None}
    for i, install in enumerate(args.torchft.split(",")):
        jobs[f"torchft {torchft_version(install)}"] = (install, 5000)
        if i == 0:  # torchft's recovery waits for the heartbeat timeout: a shorter one too
            jobs[f"torchft {torchft_version(install)}, heartbeat 1 s"] = (install, 1000)
    names = list(jobs)
    rows = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if jobs[name] is None:
                run = keep_going.one_run("continue", args, rng)
                ticks, killed_at, codes = run["ticks"], run["killed_at"], [int(not run["ok"])]
            else:
                ticks, killed_at, codes = torchft_job(args, rng, *jobs[name], kill=True)
            # from the step at which the kill came (before it, torchft's groups may still be
            # joining the first quorum one by one: printed apart)
            row = {**keep_going.recovery(ticks, killed_at, args.ranks), "codes": codes,
                   "started_again": len({t["rank"] for t in ticks if t["life"] != "0"}),
                   "samples_lost": keep_going.samples_lost(ticks, args.ranks, args.steps,
                                                           first=args.warmup),
                   "lost_before": keep_going.samples_lost(ticks, args.ranks, args.warmup - 1)}
            rows[name].append(row)
            print(f"round {r} {name:36s} went on after {row['went_on_s']:6.2f} s, full size "
                  f"after {row['full_size_s']:6.2f} s, samples lost {row['samples_lost']:4d} "
                  f"(before step {args.warmup}: {row['lost_before']}), steps trained again "
                  f"{row['lost']}, processes started again {row['started_again']}, exit codes "
                  f"{row['codes']}, load {os.getloadavg()[0]:.2f}", flush=True)
            if args.save_ticks:
                with open(args.save_ticks, "a") as out:
                    out.write(json.dumps({"round": r, "name": name, "killed_at": killed_at,
                                          "ticks": ticks}) + "\n")
    print(f"\nmedians of {args.rounds} (ranges):")
    for name in names:
        cells = []
        for key, fmt in (("went_on_s", "{:.2f} s"), ("full_size_s", "{:.2f} s"),
                         ("samples_lost", "{:.0f}"), ("lost", "{:.0f}"),
                         ("started_again", "{:.0f}")):
            values = [row[key] for row in rows[name]]
            cells.append(f"{fmt.format(statistics.median(values))} "
                         f"({fmt.format(min(values))}-{fmt.format(max(values))})")
        print(f"| {name} | " + " | ".join(cells) + " |")


def _steps(ticks, args) -> list[float]:
    return keep_going._gaps(ticks[args.warmup * args.ranks:])


def _fastest_tenth(steps: list[float]) -> float:
    """The 10th percentile: what a step takes when the machine's other work leaves it alone."""
    return statistics.quantiles(steps, n=10)[0]


def overhead(args) -> None:
    install = args.torchft.split(",")[0]
    names = ["phalanx continue", "phalanx restart", "torchft", "torch DDP"]
    times = {(name, stat): [] for name in names for stat in ("median", "p10")}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name.startswith("phalanx"):
                steps = keep_going.step_times(name.split()[1], args)
            elif name == "torchft":
                steps = _steps(torchft_job(args, None, install, 5000, kill=False)[0], args)
            else:
                token = Path(tempfile.mkdtemp(prefix="torchft-compare-"))
                cmd, env = _torchrun(args.ranks, 0, "ddp", token, args, {})
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                                     check=True).stdout
                shutil.rmtree(token, ignore_errors=True)
                steps = _steps([t for t in (keep_going.parse_tick(x, FIELDS)
                                            for x in out.splitlines()) if t], args)
            times[name, "median"].append(statistics.median(steps))
            times[name, "p10"].append(_fastest_tenth(steps))
            print(f"round {r} {name:17s} median step {times[name, 'median'][-1] * 1e3:6.1f} ms, "
                  f"10th percentile {times[name, 'p10'][-1] * 1e3:6.1f} ms, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    for stat in ("median", "p10"):
        print(f"\n{stat} step, median of {args.rounds} runs each (range):")
        for name in names:
            ts = times[name, stat]
            print(f"| {name} | {statistics.median(ts) * 1e3:.1f} ms ({min(ts) * 1e3:.1f}-"
                  f"{max(ts) * 1e3:.1f}) |")
        # each round's jobs ran one after the other: their ratio sees the same load
        for a, b in (("phalanx continue", "phalanx restart"), ("torchft", "torch DDP"),
                     ("torchft", "phalanx continue")):
            ratios = [x / y for x, y in zip(times[a, stat], times[b, stat])]
            print(f"{a} / {b}: per round {', '.join(f'{x:.2f}' for x in ratios)}, "
                  f"median {statistics.median(ratios):.3f}")


def _setup(args) -> str:
    import torch

    cpu = next((line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE.parent, check=False).stdout.strip()
    return (f"{cpu}, {os.cpu_count()} cores; torch {torch.__version__}, torchft "
            f"{', '.join(map(torchft_version, args.torchft.split(',')))}; commit {commit}; "
            f"load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("torchft", "ddp"))
    parser.add_argument("--ckpt")
    parser.add_argument("--part", choices=("failure", "overhead", "both"), default="both")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--save-every", type=int, default=10, help="phalanx's px.save")
    parser.add_argument("--torchft", default="venv", help="torchft installations to compare, "
                        "comma-separated: venv (this environment's) or `pip install --target` "
                        "folders; overhead: the first")
    parser.add_argument("--save-ticks", help="append every failure job's ticks to this file "
                        "(JSON lines)")
    args = parser.parse_args()
    args.strategy = "ddp"
    if args.worker == "torchft":
        return torchft_worker(args)
    if args.worker == "ddp":
        return ddp_worker(args)
    print(_setup(args), flush=True)
    if args.part in ("failure", "both"):
        failure(args)
    if args.part in ("overhead", "both"):
        overhead(args)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
