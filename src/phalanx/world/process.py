"""What phalanx keeps in this process from `px.init` to `px.shutdown`, in one object: `state`.

[Note: process-wide state]
Each part of `state` belongs to one module, which alone reads and changes it: the world of
runtime.py (rank, device, the job's group and its Comm, the hang watcher), the groups phalanx
made (groups.py), the live Comms and step counters, weakly (records.py), the host reads
(host.py), this rank's end (leaving.py), continue mode's session (comm/continuation.py;
continuing/session.py sets it) and its switch (comm/gate.py),
px.log's open files (observe/metrics.py), the shard services (engine/remote.py), the background
saves (checkpoint/saving.py) and global_mean's totals (data/loss.py). `px.shutdown()`
(runtime.py) ends what runs (saves, the hang watcher, the services, the groups) and then calls
`reset()`, the one place the state is reset: nothing of a job outlives it, and a second
`px.init` starts from what a new process has. A worker forked by `px.spawn` resets it before
it joins its job (launch/spawn.py). `reset()` makes each part fresh in place, so a name bound to
a part stays valid (`comm/gate.py`'s `gate`, which the collectives read).

Kept in their own modules, because they must outlive a shutdown or are not a job's:
- what the interpreter's exit reads after px.shutdown has run (leaving.py's `_script_end`: how
  the script ended, the error px.shutdown raised there, the atexit handler registered once);
- the run directory, chosen once so that a script's rounds of px.init log to one, the
  terminal px.progress draws on, and metrics' atexit handler (observe/metrics.py);
- what is registered once, at import: the functions px.shutdown runs first (runtime.py's
  `_before_shutdown`) and continue mode's start
  (comm/continuation.py's `install`);
- torch's own functions while phalanx's replace them, each put back by px.shutdown:
  clip_grad_norm_ while a model needs it, with the models it routes for (engine/clipping.py,
  [Note: the global norm]), GradScaler's methods with the scalers that scaled a loss, weakly
  (engine/amp.py), and destroy_process_group while the job's group lives (leaving.py, whose
  part of the state holds torch's function until px.shutdown puts it back);
- the job's id for checkpoint files (checkpoint/ownership.py: a process is one job, a forked
  child another);
- what only orders or names things for the process's life: map_batches' calls, whose number
  names store keys that a later px.init must not reuse (data/inference.py), the order of the
  batches the samplers serve (data/ledger.py), and the seconds spent waiting for data, read
  as differences (observe/step_report.py);
- the trace of the whole process, written at px.shutdown and at its exit (observe/trace.py);
- the Ctrl-C handler that px.spawn holds while it forks a worker, which that worker reads
  first (launch/spawn.py's `_ctrl_c_handler`).

A leaf module: it imports nothing of phalanx, so every module may import it.
"""

from __future__ import annotations

import datetime
import weakref
from collections import defaultdict
from dataclasses import dataclass, field, fields

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["ProcessState", "state", "reset"]


@dataclass
class World:
    """runtime.py: this rank's place in the job, and what watches the job's group."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    initialized: bool = False
    owns_group: bool = False  # True when init() created the group (so shutdown destroys it)
    world: object = None  # the job's group this init joined (outside continue mode)
    watch: tuple | None = None  # (timeout, hang_after) of init, for a new generation's watcher
    hang_watch: object = None  # faults/hangs.py's HangWatch over the job's group
    comm: object = None  # the Comm of the job's group (`world/runtime.py`'s `default_comm`)


@dataclass
class Groups:
    """groups.py: the process groups phalanx made beside the job's."""
    timeout: datetime.timedelta | None = None  # px.init's timeout, once known
    made: dict = field(default_factory=dict)  # (id(parent), purpose) -> (parent, group)
    on_end: list = field(default_factory=list)  # called first by end_all (engine/remote.py)


@dataclass
class Records:
    """records.py: the live Comms and step counters (weakly), and counts per process group."""
    live: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    counters: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    group_seq: defaultdict = field(default_factory=lambda: defaultdict(int))
    blocking_done: defaultdict = field(default_factory=lambda: defaultdict(int))
    on_blocking_done: list = field(default_factory=list)


@dataclass
class HostReads:
    """host.py: device values read by the host through `host.read` since `px.init`."""
    count: int = 0


@dataclass
class Leaving:
    """leaving.py: this rank's end, announced and waited for in the job's store."""
    store: object = None  # None: no peers to wait for (no `leaving.start` since px.init)
    rank: int = 0
    world: int = 1
    timeout: float = 0.0
    prefix: str = ""  # this px.init's keys in the store
    end: object = None  # px.shutdown, for torch's destroy_process_group routed to it
    at_exit: object = None  # px.shutdown, for the end of the script to call
    torch_destroy: object = None  # torch's destroy_process_group while ours is installed
    left: bool = False
    said_after: float = 0.0  # seconds after which a wait at the end says what it waits for
    failing: bool = False


@dataclass(slots=True)
class Gate:
    """comm/gate.py: the switch every collective reads under `--on-failure continue`."""
    active: bool = False   # --on-failure continue
    cut: bool = False      # the step in flight is lost: collectives do nothing
    poked: bool = False    # the others went on and asked this rank to report (steps.py)
    on_loss: object = None  # called once with the first error (membership.py)


@dataclass
class Continuing:
    """comm/continuation.py: continue mode for this process, one object (`now()`)."""
    session: object = None  # continuing/session.py's Session, made at px.init; None when off


@dataclass
class Metrics:
    """observe/metrics.py: px.log's open files and what it writes with them."""
    run: dict | None = None  # what px.prepare knows of the run, for run.json
    csv: tuple | None = None  # (file, csv writer)
    tensorboard: object = None  # a SummaryWriter, or None
    t0: float = 0.0  # when the files were opened (time.monotonic)


@dataclass
class ProcessState:
    """Every part, by the name of the module it belongs to."""
    world: World = field(default_factory=World)
    groups: Groups = field(default_factory=Groups)
    records: Records = field(default_factory=Records)
    host: HostReads = field(default_factory=HostReads)
    leaving: Leaving = field(default_factory=Leaving)
    gate: Gate = field(default_factory=Gate)
    continuing: Continuing = field(default_factory=Continuing)
    metrics: Metrics = field(default_factory=Metrics)
    # engine/remote.py: id(group) -> (group, ShardService)
    services: dict = field(default_factory=dict)
    # checkpoint/saving.py: background saves still being written
    saves: list = field(default_factory=list)
    # checkpoint/saving.py: the last background save's copies, kept for the next one
    staged: dict = field(default_factory=dict)
    # data/loss.py: count tensor (weakly) -> (its _version, the Comm, the reduced total)
    loss_totals: WeakTensorKeyDictionary = field(default_factory=WeakTensorKeyDictionary)


state = ProcessState()


def reset() -> None:
    """Every part as a new process has it, each in place (see the module's docstring)."""
    for f in fields(state):
        part = getattr(state, f.name)
        if hasattr(part, "__dataclass_fields__"):
            part.__init__()
        else:
            part.clear()
