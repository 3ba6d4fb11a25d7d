"""The step report (`px.step_stats`), `px.log` and `phalanx report`, on real 2-rank runs.

Each check compares the report with something measured independently: the test's own clock
around each phase of the loop, a delay put on one rank on purpose, the planner's figure for the
bytes a step communicates.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import load_clock
import pytest
import torch
import torch.nn as nn

import phalanx as px
from phalanx.testing import run_ranks

DATA_WAIT = 0.03  # seconds the loop "waits for data" before each step


def deep_model(width=256, depth=6):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(depth)])


def timed_loop(steps, bucket_mb=25.0, slow_rank=None, slow_s=0.0, log_dir=None, depth=6,
               batch=64, floor=0.0):
    """Train with the test's own clock around each phase; return both views per step.
    `floor`: seconds slept inside each phase (a forward hook, a backward hook, an optimizer
    step hook), a least time for each that no load on the machine can shorten."""
    px.init()
    model = deep_model(depth=depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if floor:
        model[0].register_forward_hook(lambda *_: time.sleep(floor))
        model[0].register_full_backward_hook(lambda *_: time.sleep(floor))
        opt.register_step_pre_hook(lambda *_: time.sleep(floor))
    model, opt = px.prepare(model, opt, bucket_mb=bucket_mb)
    if log_dir is not None:
        os.environ["PHALANX_RUN_DIR"] = log_dir
    rows = []
    last_end = time.perf_counter()
    for step in range(steps):
        time.sleep(DATA_WAIT + (slow_s if px.rank() == slow_rank else 0.0))
        x = torch.randn(batch, 256)
        t0 = time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        out.square().mean().backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad()
        mine = {"wall": t3 - last_end, "forward": t1 - t0, "backward": t2 - t1,
                "optimizer": t3 - t2}
        stats = px.step_stats(model)
        last_end = time.perf_counter()  # step_stats and zero_grad count as the next step's other
        everyone = px.step_stats(model, all_ranks=True)
        if log_dir is not None:
            px.log({"who": px.rank(), **everyone}, step)
        rows.append((mine, stats, everyone))
    return rows


def test_the_parts_lie_within_the_loops_own_clock_and_add_up():
    """Each part is timed inside the loop's own window around that call (so never longer,
    however loaded the machine), holds the time slept inside it on purpose (so it is that
    part's time and not another's), and the parts add up to the step's wall."""
    floor, tick = 0.02, 1e-4  # tick: two clock readings' rounding
    for rank_rows in run_ranks(timed_loop, 2, args=(6,), kwargs={"floor": floor}, timeout=120):
        for mine, stats, _ in rank_rows[2:]:
            wall = stats["wall_s"]
            parts = sum(stats[k] for k in ("forward_s", "backward_s", "optimizer_s", "data_s",
                                           "other_s"))
            assert parts == pytest.approx(wall, abs=tick), stats
            for name in ("forward", "backward", "optimizer"):
                assert stats[f"{name}_s"] >= floor, (name, stats)
            assert stats["forward_s"] <= mine["forward"] + tick, (mine, stats)
            assert stats["backward_s"] <= mine["backward"] + tick, (mine, stats)
            # the optimizer's part runs from the backward's end, inside the loop's backward call
            assert stats["backward_s"] + stats["optimizer_s"] <= \
                mine["backward"] + mine["optimizer"] + tick, (mine, stats)
            # the data wait is the other part; the wall is the loop's own, from one step's end
            assert stats["other_s"] >= DATA_WAIT * 0.95, stats
            assert stats["exposed_comm_s"] <= stats["backward_s"] + stats["optimizer_s"] \
                + stats["other_s"] + 1e-6
            assert stats["samples"] == 64 and stats["samples_per_s"] == \
                pytest.approx(64 / wall)


# a timing claim (how much of the communication hides behind backward on this CPU): it holds on
# a quiet machine and not beside other work, so it is in the slow tier; benchmarks/ddp.py
# measures overlap itself
@pytest.mark.slow
def test_overlap_is_near_zero_with_one_bucket_and_clearly_above_with_many():
    """The engine's own collectives only: the all-gather of step_stats(all_ranks=True) is a
    blocking call, exposed by nature, and is outside the window of the step it reports."""
    one = run_ranks(timed_loop, 2, kwargs={"steps": 6, "depth": 1, "slow_rank": 1,
                                           "slow_s": 0.03}, timeout=120)
    many = run_ranks(timed_loop, 2, kwargs={"steps": 6, "bucket_mb": 0.2, "batch": 512},
                     timeout=120)
    # one layer, one bucket: it goes out with the last gradient, and rank 0 waits in it for
    # rank 1, which is 30 ms late: nothing is left to overlap with
    one_overlap = statistics.median(s["overlap"] for _, s, _ in one[0][2:])
    # a bucket per layer goes out while earlier layers' gradients are still computed
    many_overlap = statistics.median(s["overlap"] for rows in many for _, s, _ in rows[2:])
    assert one_overlap < 0.1, one_overlap
    assert many_overlap > 0.3, many_overlap
    assert all(s["all_reduce/count"] == 1 for rows in one for _, s, _ in rows[2:])
    # (a weight over the 0.2 MiB cap is a unit of its own, its bias another)
    assert all(s["all_reduce/count"] == 12 for rows in many for _, s, _ in rows[2:])


def test_bytes_per_step_are_the_planners_figure():
    rows = run_ranks(timed_loop, 2, args=(4,), timeout=120)
    planned = px.plan(deep_model(), gpus=2, precision="fp32", optimizer="sgd",
                      strategy="ddp", backend="gloo", input_shape="256")["ddp"]
    for rank_rows in rows:
        for _, stats, _ in rank_rows[2:]:
            # buckets also carry the used-flags and the non-finite slot: a few bytes more
            assert stats["all_reduce/bytes"] == pytest.approx(
                planned.comm_payload_bytes["all_reduce"], rel=2e-3), stats


def test_the_slowed_rank_is_named_the_straggler():
    """Rank 1 sleeps 0.25 s more than rank 0 before each step: far more than the few
    milliseconds either computes, and than what other work on the machine takes from one of
    them, so it is the slowest in every step, by about the sleep."""
    slow_s = 0.25
    rows = run_ranks(timed_loop, 2, kwargs={"steps": 5, "slow_rank": 1, "slow_s": slow_s},
                     timeout=120)
    for rank_rows in rows:
        for _, _, everyone in rank_rows[2:]:
            assert everyone["slowest_rank"] == 1, everyone
            assert everyone["skew_s"] >= 0.6 * slow_s, everyone
            # at most the sleep and rank 1's whole step besides it
            assert everyone["skew_s"] <= everyone["rank1/busy_s"], everyone


def test_rank0_logs_and_the_report_renders(tmp_path):
    run_dir = str(tmp_path / "run")
    run_ranks(timed_loop, 2, kwargs={"steps": 5, "log_dir": run_dir}, timeout=120)
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        lines = f.read().splitlines()
    assert lines[0] == "step,name,value,seconds"
    who = [line.split(",")[2] for line in lines[1:] if line.split(",")[1] == "who"]
    assert who == ["0"] * 5  # rank 1's calls wrote nothing
    result = subprocess.run([sys.executable, "-m", "phalanx", "report", run_dir],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("5 steps logged; medians over steps 2-5:"), result.stdout
    assert "slowest rank" in result.stdout
    # the planner's bytes for this run (run.json, from px.prepare) beside the measured ones
    assert "phalanx plan for this run (0.39M parameters, ddp, fp32, 2 ranks)" in result.stdout
    row = next(line for line in result.stdout.splitlines()
               if line.strip().startswith("all_reduce bytes/step"))
    planned, measured = row.split()[2], row.split()[4]
    assert abs(float(planned) - float(measured)) <= 0.002 * float(planned), row
    import matplotlib.image

    for name in ("step_time.png", "overlap.png", "memory.png"):
        image = matplotlib.image.imread(os.path.join(run_dir, name))
        assert image.shape[0] > 100 and image.shape[1] > 100
    assert open(os.path.join(run_dir, "summary.txt")).read().startswith("5 steps logged")


def test_report_of_a_directory_without_metrics_says_what_to_give(tmp_path):
    result = subprocess.run([sys.executable, "-m", "phalanx", "report", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "metrics.csv does not exist: give the run directory that px.log wrote" in \
        result.stderr


def traced_run(run_dir):
    os.environ["PHALANX_TRACE"] = run_dir
    px.init()
    model = deep_model(depth=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = px.prepare(model, opt, bucket_mb=0.2)
    reports = []
    for _ in range(3):
        model(torch.randn(32, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        reports.append(px.step_stats(model))
    with torch.profiler.profile() as prof:
        model(torch.randn(32, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    labels = {e.key for e in prof.key_averages() if e.key.startswith("phalanx::")}
    px.shutdown()  # writes the trace
    return reports, labels


def test_the_trace_has_every_phase_and_collective_and_profiler_labels_match(tmp_path):
    import json

    results = run_ranks(traced_run, 2, args=(str(tmp_path),), timeout=120)
    for rank, (reports, labels) in enumerate(results):
        with open(tmp_path / f"trace_rank{rank}.json") as f:
            events = json.load(f)["traceEvents"]
        lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert lanes[0] == "compute" and lanes[1] == "collectives 0"
        spans = [e for e in events if e["ph"] == "X"]
        for step, report in enumerate(reports):
            phases = {e["name"]: e["dur"] / 1e6 for e in spans
                      if e["tid"] == 0 and e["args"]["step"] == step}
            assert set(phases) == {"forward", "backward", "optimizer"}, phases
            assert phases["backward"] == pytest.approx(report["backward_s"], rel=1e-6)
            grads = [e for e in spans if e["tid"] >= 1 and e["args"]["step"] == step
                     and e["name"].endswith(":grads all_reduce")]
            assert len(grads) == report["all_reduce/count"] == 6  # weight and bias per layer
            assert sum(e["args"]["bytes"] for e in grads) == report["all_reduce/bytes"]
        # the profiler names the same collectives the same way
        assert {f"phalanx::unit[{i}]:grads::all_reduce" for i in range(6)} <= labels, labels


class SlowDataset(torch.utils.data.Dataset):
    """Each sample takes at least 5 ms to load; `loading` collects how long each load took
    (the loader has no workers: the loads run in the loop's own process, inside its wait)."""

    def __init__(self):
        self.loading = []

    def __len__(self):
        return 64

    def __getitem__(self, i):
        began = time.perf_counter()
        time.sleep(0.005)
        sample = torch.full((256,), float(i))
        self.loading.append(time.perf_counter() - began)
        return sample


def loader_loop():
    """Each step's report, with the loop's own clock around its wait for the batch (`next` on
    the loader's iterator) and the dataset's around the loads of that batch."""
    px.init()
    model = deep_model(depth=2)
    model, opt = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    data = SlowDataset()
    batches = iter(px.data_loader(data, 4, shuffle=False))
    seen = []
    while True:
        began = time.perf_counter()
        x = next(batches, None)
        waited = time.perf_counter() - began
        if x is None:
            return seen
        loading, data.loading = sum(data.loading), []
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        seen.append({**px.step_stats(model), "waited": waited, "loading": loading})


def test_the_wait_for_px_data_loader_is_its_own_part():
    """data_s is the step's wait for its batch of px.data_loader, and no other part holds it:
    it takes in the loads of that batch (4 samples of at least 5 ms each) and lies within the
    loop's own clock around `next`. Both bounds are measured in the same step, so a loaded
    machine, which lengthens the loads and the wait alike, moves them together."""
    for seen in run_ranks(loader_loop, 2, timeout=load_clock.scaled(120)):
        for stats in seen[1:]:
            assert 0.02 <= stats["loading"] <= stats["data_s"] <= stats["waited"], stats
            # the parts add up to the step's wall time: the wait is counted once, as data_s,
            # not in other_s as well (nor instead)
            parts = sum(stats[k] for k in ("forward_s", "backward_s", "optimizer_s", "data_s",
                                           "other_s"))
            assert parts == pytest.approx(stats["wall_s"], rel=1e-9, abs=1e-9), stats


def test_the_progress_bar_is_drawn_on_the_launchers_terminal_by_rank0_only():
    """Workers' output is piped through the launcher, line by line; the bar goes to the
    terminal `phalanx run` was started from (here a pseudo-terminal)."""
    import pty
    import select

    master, slave = pty.openpty()
    script = os.path.join(os.path.dirname(__file__), "launch_scripts", "progress.py")
    proc = subprocess.Popen([sys.executable, "-m", "phalanx", "run", "-n", "2", script],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if not select.select([master], [], [], 1.0)[0]:
            continue  # nothing yet: look at the clock again rather than block on the read
        try:
            chunk = os.read(master, 65536)
        except OSError:  # every holder of the terminal is gone
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    if proc.poll() is None:  # still running after the deadline: a stuck job fails the test
        proc.kill()
    assert proc.wait(timeout=30) == 0, seen.decode(errors="replace")
    text = seen.decode(errors="replace")
    assert "work0: 100%" in text and "10/10" in text, text
    assert "work1" not in text, text


def test_tensorboard_gets_the_same_scalars_when_installed(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from phalanx.observe import metrics as metrics_log

    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path))
    metrics_log.close()  # files a test before opened, in another run directory
    monkeypatch.setattr(metrics_log, "_lasting", {})
    for step in range(4):
        px.log({"loss": 1.0 / (step + 1)}, step, every=0)
    metrics_log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == \
        [(s, pytest.approx(1.0 / (s + 1))) for s in range(4)]
