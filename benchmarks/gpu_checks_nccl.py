"""The checks of benchmarks/gpu_accept.py that talk through NCCL: the completion stamp of a
collective (one GPU), parity and the hang report at two ranks (two GPUs or more)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path


def register_nccl_checks(check, verdict, gpt, two_rank_f64, max_rel, strategies, one_group):
    import torch

    @check("nccl-completion-stamp", dry=False)
    def completion(dry):
        """A collective's completion is read from the device, not from NCCL's future (which
        completes at enqueue): after 50 ms of queued work, a 512 MB all-reduce's recorded time
        in flight against the CUDA events around both."""
        import torch.distributed as dist

        from phalanx.comm.collectives import Comm
        one_group("nccl")
        comm = Comm(dist.group.WORLD)
        big = torch.ones(128 * 2**20, device="cuda")
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)  # about 50 ms of GPU time on current clocks
        handle = comm.all_reduce(big, async_op=True, tag="accept")
        end.record()
        rec = handle.records[0]
        deadline = time.monotonic() + 30
        while rec.completed is None and time.monotonic() < deadline:
            handle.is_completed()
            time.sleep(0.001)
        torch.cuda.synchronize()
        recorded = (rec.completed or rec.started) - rec.started
        ratio = recorded / (start.elapsed_time(end) / 1e3)
        return verdict(ratio >= 0.5, ratio, "recorded in flight / device time (>= 0.5; a "
                       "future stamped at enqueue gives about 0)")

    def nccl_rank(strategy, dry):
        os.environ.pop("PHALANX_BACKEND", None)
        os.environ.pop("PHALANX_DEVICE", None)
        return two_rank_f64(strategy, dry)

    @check("nccl-parity-2ranks", gpus=2, dry=False)
    def nccl_parity(dry):
        """float64 at 2 ranks over NCCL, one GPU each, against one process."""
        from phalanx.launch.spawn import run_workers
        want = two_rank_f64(None, dry)
        worst = 0.0
        for strategy in strategies:
            got = run_workers(nccl_rank, 2, (strategy, dry), timeout=240,
                              start_method="spawn")[0]
            worst = max(worst, max_rel(got, want))
        return verdict(worst <= 1e-10, worst, "max rel difference to one process (<= 1e-10)")

    @check("nccl-hang-report", gpus=2, dry=False)
    def hang(dry):
        """Rank 1 sleeps 90 s in a 2-rank NCCL job with PHALANX_HANG_AFTER=20: a report
        naming rank 1 within 40 s."""
        script = Path(os.environ.get("TMPDIR", "/tmp")) / "phalanx_accept_hang.py"
        script.write_text(textwrap.dedent("""
            import time, torch, phalanx as px
            px.init()
            model = torch.nn.Linear(64, 64)
            model, opt = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for step in range(5):
                if step == 3 and px.rank() == 1:
                    time.sleep(90)
                model(torch.randn(8, 64)).square().mean().backward()
                opt.step(); opt.zero_grad()
        """))
        env = dict(os.environ, PHALANX_HANG_AFTER="20")
        t = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(script)],
                              capture_output=True, text=True, timeout=200, env=env)
        took = time.monotonic() - t
        named = "rank 1 has not entered" in done.stderr
        return verdict(named and took < 60, took, f"seconds to the report (< 40 after the "
                       f"threshold's 20 and start-up); rank 1 named: {named}")

    return completion, nccl_parity, hang
