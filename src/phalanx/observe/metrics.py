"""Metrics without extra code: `px.log` and `px.progress`, written by rank 0 only.

Any rank may call `px.log(metrics, step)`; on rank 0 each numeric value becomes a row of
`metrics.csv` in the run directory (long format, `step,name,value,seconds`, so the names may
change from call to call), a scalar in TensorBoard when `torch.utils.tensorboard` can be
imported (the `tensorboard` package is optional), and every `every`-th step one plain line on
stdout. Other ranks return at once: nothing is gathered, so logging adds no collective (log
`px.step_stats(model, all_ranks=True)` or a `px.global_mean` for values over all ranks).

The run directory is PHALANX_RUN_DIR when set, else `runs/phalanx-<date>-<time>` under the
working directory, made at the first write. `phalanx report RUN_DIR` turns it into plots.
"""

from __future__ import annotations

import atexit
import csv
import json
import os
import sys
import time
from collections.abc import Mapping

from ..comm import records
from ..world import environment, runtime
from ..world.process import state

__all__ = ["log", "progress", "run_dir", "close"]

# Kept for the process's life, not in state.metrics (which px.shutdown resets): the run
# directory, chosen once, so that a script's rounds of px.init and px.shutdown log to one;
# the terminal px.progress draws on; and "closing": `close` is registered with atexit.
_lasting: dict = {}


def default_run_dir() -> str:
    """`runs/phalanx-<date>-<time>` under the working directory."""
    return os.path.join("runs", time.strftime("phalanx-%Y%m%d-%H%M%S"))


def run_dir() -> str:
    """The run directory that rank 0 writes to (made on first use)."""
    path = _lasting.get("dir")
    if path is None:
        path = environment.value("PHALANX_RUN_DIR") or default_run_dir()
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot make the run directory {path} (px.log's metrics "
                          f"and PHALANX_TRACE's traces go there): {exc.strerror or exc}; set "
                          "PHALANX_RUN_DIR to a directory this user can write to") from None
        _lasting["dir"] = path
    return path


def _number(value):
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None


def note_run(info: dict) -> None:
    """What `px.prepare` knows of the run (strategy, world, parameters...), written to
    RUN_DIR/run.json with the first metrics, for `phalanx report` to ask the planner."""
    state.metrics.run = info


def _writers():
    now = state.metrics
    if now.csv is None:
        if now.run is not None:
            with open(os.path.join(run_dir(), "run.json"), "w") as f:
                json.dump(now.run, f, indent=1)
        path = os.path.join(run_dir(), "metrics.csv")
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        f = open(path, "a", newline="")
        writer = csv.writer(f)
        if new:
            writer.writerow(["step", "name", "value", "seconds"])
        now.csv = (f, writer)
        now.t0 = time.monotonic()
        try:
            from torch.utils.tensorboard import SummaryWriter
            now.tensorboard = SummaryWriter(os.path.join(run_dir(), "tensorboard"))
        except Exception:  # noqa: BLE001 - tensorboard is not installed: the CSV is enough
            now.tensorboard = None
        if not _lasting.get("closing"):  # TensorBoard queues events in a thread: flush them
            _lasting["closing"] = True
            atexit.register(close)
            runtime.before_shutdown(close)
    return now.csv, now.tensorboard


def log(metrics: dict, step: int | None = None, *, every: int | None = None) -> None:
    """Record `metrics` (name -> number) at `step` (default: optimizer steps taken so far, by
    the prepared model that has taken the most).

    Rank 0 writes them to RUN_DIR/metrics.csv, to TensorBoard when installed, and, every
    `every` steps (default PHALANX_LOG_EVERY, else 10), as one line on stdout; other ranks do
    nothing. Values that are not numbers are left out."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"px.log(metrics, step=None) takes a dict of name -> number, not "
                        f"{type(metrics).__name__} {metrics!r:.60}; for example "
                        "px.log({'loss': loss.item()}, step=step)")
    if runtime.rank() != 0:
        return
    step = records.current_step() if step is None else int(step)
    values = {str(k): v for k, v in ((k, _number(v)) for k, v in metrics.items())
              if v is not None}
    (f, writer), tb = _writers()
    seconds = round(time.monotonic() - state.metrics.t0, 6)
    for name, value in values.items():
        writer.writerow([step, name, repr(value), seconds])
        if tb is not None:
            tb.add_scalar(name, value, step)
    f.flush()
    if every is None:
        every = environment.value("PHALANX_LOG_EVERY") or 10
    if every > 0 and step % every == 0:
        shown = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in values.items() if "/" not in k)
        print(f"step {step}  {shown}", flush=True)


def close() -> None:
    """Close the files `log` opened, flushing TensorBoard's queued events (`px.shutdown()` and
    the exit of the process call it, `phalanx run`'s and `px.spawn`'s workers too; `log`
    reopens them if called again)."""
    now = state.metrics
    entry, tb, now.csv, now.tensorboard = now.csv, now.tensorboard, None, None
    if entry is not None:
        entry[0].close()
    if tb is not None:
        tb.close()


def progress(iterable=None, **tqdm_kwargs):
    """`iterable` with a tqdm progress bar on rank 0, unchanged on the other ranks.

    The bar is drawn on a terminal only: under `phalanx run` on the terminal the launcher was
    started from (PHALANX_TTY, which it sets), else on stderr when that is a terminal (tqdm's
    `disable=None`); in a log file or CI there is no bar, and `px.log`'s lines remain."""
    if runtime.rank() != 0:
        return iterable if iterable is not None else _Null()
    from tqdm.auto import tqdm

    try:
        tty = environment.value("PHALANX_TTY")
    except ValueError:  # checked by px.init: a terminal closed since is no reason to stop
        tty = None
    if tty and "file" not in tqdm_kwargs:
        try:
            tqdm_kwargs["file"] = _lasting.get("tty") or _lasting.setdefault("tty", open(tty, "w"))
            tqdm_kwargs.setdefault("disable", False)
        except OSError:
            pass
    tqdm_kwargs.setdefault("file", sys.stderr)
    tqdm_kwargs.setdefault("disable", None)
    return tqdm(iterable, **tqdm_kwargs)


class _Null:
    """What `progress()` without an iterable gives other ranks: a bar that does nothing."""

    def update(self, *args, **kwargs):
        pass

    def close(self):
        pass

    def set_postfix(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
