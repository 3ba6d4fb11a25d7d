"""A timeline per rank: forward, backward, optimizer step and every collective, for Perfetto.

With PHALANX_TRACE=1 (or a directory) each rank writes `trace_rank<R>.json` in the run
directory (observe/metrics.py) when `px.shutdown()` runs, or at exit: Chrome's trace-event format,
which https://ui.perfetto.dev and chrome://tracing open. One process per rank; its lanes are
"compute" (forward, backward and optimizer of every step, from the step clock of
observe/step_report.py) and "collectives 0, 1, ..." (each collective from issue to completion, from
its record in collectives.py, named by its tag and kind, with its bytes and the time the training
thread waited for it; collectives in flight together go to separate lanes). Ranks of one
machine share the clock (CLOCK_MONOTONIC), so their timelines line up when opened together.

Under `torch.profiler`, phalanx's collectives are also labelled where they are issued
(`phalanx::unit[3]:grads::all_reduce`, see `Comm`), so a profiler trace names them the same way.
"""

from __future__ import annotations

import atexit
import json
import os

from ..world import environment, runtime
from .metrics import run_dir

__all__ = ["Tracer", "tracer"]

_LIMIT = 200_000  # events kept per rank (the oldest are dropped beyond)


class Tracer:
    def __init__(self, rank: int, path: str):
        self.rank = rank
        self.path = path
        self.events: list[dict] = []
        self._lanes_end: list[float] = []  # when each collectives lane is free again
        self.written = False

    def _add(self, event: dict) -> None:
        if len(self.events) >= _LIMIT:
            del self.events[:len(self.events) // 10]
        self.events.append(event)

    def phase(self, name: str, began: float, ended: float, step: int) -> None:
        """A span on the compute lane (perf_counter seconds)."""
        self._add({"name": name, "ph": "X", "pid": self.rank, "tid": 0, "ts": began * 1e6,
                   "dur": max(ended - began, 0.0) * 1e6, "args": {"step": step}})

    def collective(self, rec) -> None:
        lane = next((i for i, end in enumerate(self._lanes_end) if end <= rec.started), None)
        if lane is None:
            lane = len(self._lanes_end)
            self._lanes_end.append(0.0)
        self._lanes_end[lane] = rec.completed
        self._add({"name": f"{rec.tag or 'collective'} {rec.kind}", "ph": "X",
                   "pid": self.rank, "tid": 1 + lane, "ts": rec.started * 1e6,
                   "dur": (rec.completed - rec.started) * 1e6,
                   "args": {"bytes": rec.nbytes, "seq": rec.group_seq, "step": rec.step,
                            "waited_ms": round(rec.waited * 1e3, 3)}})

    def write(self) -> str:
        names = [("compute", 0)] + [(f"collectives {i}", 1 + i)
                                    for i in range(len(self._lanes_end))]
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                  "args": {"name": name}} for name, tid in names]
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)
        self.written = True
        return self.path


_tracer: dict = {}


def tracer(rank: int) -> Tracer | None:
    """This process's tracer when PHALANX_TRACE asks for one (made once), else None."""
    setting = environment.value("PHALANX_TRACE")  # None or False: off; True: the run directory
    if not setting:
        return None
    if "t" not in _tracer:
        where = run_dir() if setting is True else setting
        t = _tracer["t"] = Tracer(rank, os.path.join(where, f"trace_rank{rank}.json"))
        runtime.before_shutdown(t.write)
        atexit.register(lambda: t.written or t.write())
    return _tracer["t"]
