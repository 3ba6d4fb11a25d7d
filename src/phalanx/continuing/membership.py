"""Who is in the job now, under `phalanx run --on-failure continue`: generations of members.

[Note: generations]
A generation is a set of members (each known by its launch rank, the RANK its agent gave it,
which a replacement keeps) and the process group they form, made through the job's store
(store.py) under the prefix `gen<g>/pg`, so a new group never meets an old one's keys.
Generation 0 is the launch: every rank. A member's rank in the group (`px.rank()`) is its
place among the members sorted by launch rank, so after a replacement has joined, every rank
is again its launch rank.

A generation ends when a collective fails because a member is gone (comm/gate.py cuts the
wire): this rank destroys its end of the group at once, so that a peer waiting on it fails too
instead of waiting out the timeout, and the rest of its step runs alone. At its next
`optimizer.step()` (or `px.shutdown()`) it reports to the store and waits until every member
has either reported or is known gone (its agent wrote `left/`, or it said `done/`); then
every survivor computes the same decision from the same reports (steps.py) and joins the next
generation's group. The old group is never used again: its collectives in flight have failed
or been abandoned, and each rank destroyed it.

Nothing here runs outside continue mode: `px.init` makes a `Membership` only there.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch.distributed as dist

from ..comm import groups, records
from ..comm.continuation import MembershipError
from ..comm.gate import gate
from ..world import environment
from . import store as keys

__all__ = ["Membership", "MembershipError"]

_POLL = 0.005  # seconds between two looks at the store while waiting for the others


def debug(message: str) -> None:
    """One line on stderr per transition when PHALANX_DEBUG_ELASTIC=1 (for a report)."""
    if environment.value("PHALANX_DEBUG_ELASTIC"):
        print(f"phalanx elastic [rank {os.environ.get('RANK')}, life "
              f"{environment.value('PHALANX_JOINING') or 0}]: {message}", file=sys.stderr,
              flush=True)


class Membership:
    """This process's view of the generations (see [Note: generations])."""

    def __init__(self, client_store, rank: int, world: int, life: int, backend: str,
                 timeout: datetime.timedelta, device):
        self.store = keys.keyspace(client_store)
        self.me = rank            # the launch rank: this process's name across generations
        self.life = life          # 0: launched with the job; k: the k-th replacement of `me`
        self.launch_world = world
        self.backend = backend
        self.timeout = timeout
        self.device = device
        self.gen = 0
        self.members: list[tuple[int, int]] = [(r, 0) for r in range(world)]  # (rank, life)
        self.joining = life > 0   # a replacement, not yet admitted (joining.py)
        self.admitting = False    # a replacement between its admission and its first step
        self.on_regroup: list = []   # called with the new group after one is formed
        self.on_drop: list = []      # called as the group is dropped: let go of it

    # -- the group ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the current generation's group."""
        return [r for r, _ in self.members].index(self.me)

    @property
    def world(self) -> int:
        return len(self.members)

    def start(self) -> None:
        """Generation 0 at launch (a replacement waits to be admitted instead: joining.py)."""
        if not self.joining:
            self.form(0, self.members)

    def form(self, gen: int, members: list[tuple[int, int]]) -> bool:
        """Make generation `gen`'s group of `members` (every member calls this, with the same
        arguments) and move every Comm of the job's group over to it. False when a member was
        lost before the group was made: the wire is then cut (gate.py), and the next step
        boundary recovers from generation `gen` as from any loss."""
        self.gen, self.members = gen, sorted(members)
        debug(f"form gen {gen} members {self.members}")
        try:
            missing = self._arrive(gen)
            if missing is None:
                kwargs = {"device_id": self.device} if "nccl" in self.backend else {}
                dist.init_process_group(backend=self.backend,
                                        store=dist.PrefixStore(f"gen{gen}/pg", self.store),
                                        rank=self.rank, world_size=self.world,
                                        timeout=self.timeout, **kwargs)
        except RuntimeError as exc:  # a member lost while the group connected
            missing = str(exc)
        if missing is not None:
            debug(f"gen {gen} not formed: {missing}"[:200])
            self.drop_group()
            gate.cut = True
            return False
        new = dist.group.WORLD
        gate.poked = False  # a request to report is for the generation that asked it
        if self.rank == 0:  # for a replacement waiting to join: who may still admit it
            keys.write(self.store, f"gen{gen}/members", self.members)
            keys.write(self.store, "gen", gen)
        if gen > 0 or self.life > 0:
            for comm in records.live():
                if comm.group is None and getattr(comm, "waiting", False):
                    comm.waiting = False
                    comm.regroup(new, name="world")
            for fn in list(self.on_regroup):
                fn(new)
        return True

    def _arrive(self, gen: int) -> str | None:
        """Wait until every member of `gen` has come to make its group (None), or one is gone
        first (what happened; torch's group would wait for it until the timeout)."""
        keys.write(self.store, f"gen{gen}/arrived/{self.me}", True)
        pending = set(self.members)
        lost: list = []

        def arrived() -> bool:
            for rank, life in list(pending):
                if keys.has(self.store, f"gen{gen}/arrived/{rank}"):
                    pending.discard((rank, life))
                elif self.gone(rank, life) is not None:
                    lost.append(f"rank {rank} was lost before generation {gen} was formed")
                    return True
            return not pending

        self.wait_for(f"every member of generation {gen}", arrived)
        return lost[0] if lost else None

    def drop_group(self) -> None:
        """Destroy this rank's end of the current group (and every group made from it): a peer
        blocked on this rank then fails at once rather than at the timeout.

        Gloo closes a group's connections only when nothing holds the group any more, so every
        holder lets go first: each Comm (those of the job's group wait, without one, for the
        next generation's; those of groups made apart from it end with it), the step clocks
        (`on_drop`), the shard services (groups.py's end hooks). A group left alive here kept
        a peer blocked in a collective on this rank until its hang report, 200 s later. And
        gloo's destruction itself first runs what is still queued on the group: nothing there
        may wait on another survivor that is destroying its own end, or both wait there until
        the collective timeout, silently (zero3's gathers did: [Note: an all-gather a loss
        cannot tie] in collectives.py).

        A collective lost with the group never completes, and its Comm's records go with it
        to the next generation's group: each is stamped ended here, or the hang watcher read
        it as in flight there, a hang one threshold later that ended the job (a rank frozen
        while the others waited in its px.save's first collective, under zero2)."""
        if not dist.is_initialized():
            return
        now = time.perf_counter()
        for comm in records.live():
            if comm.group is not None:
                comm.waiting = comm.name == "world"
                comm.group = None
                records.drop_in_flight(comm)
                for rec in list(comm.records):
                    if rec.completed is None:
                        rec.completed = now
        for fn in list(self.on_drop):
            fn()
        groups.forget_all()
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - a group broken may fail to end cleanly: it is gone either way
            debug(f"destroying the group: {exc}"[:200])

    def write(self, key: str, value) -> None:
        """Say `value` under `key` in the job's keys (store.py), as this member."""
        keys.write(self.store, key, value)

    def post_over(self, why: str) -> None:
        """The job cannot go on: say so to the agents, who then replace nobody (store.py)."""
        keys.post_over(self.store, why)

    def remove_hung(self, ranks: list[int]) -> None:
        """[Note: a member that hangs]
        A member can hang without dying: frozen (SIGSTOP, a debugger), stuck in native code,
        or alive outside any collective for longer than the hang threshold. Nothing then
        fails: the others wait in a collective with it, and their hang report (faults/hangs.py)
        names it. Ending the others (as outside continue mode) would leave the job to the
        one that hangs: their agents would replace them, and the replacements wait forever
        for an admission that only a member can give. So under continue mode the report's
        rank asks, through the store, that the ranks it names be removed
        (`remove/<rank>.<life>`): their agents end them (SIGKILL, which a frozen process
        receives too: launch/continuing.py) and say so in `left/`; the others' collectives
        then fail as after a kill, the step is redone without them, and a replacement joins
        at the next px.save. When the report names nobody (every rank is inside a collective
        that does not complete, or they issued different ones), or every member, the job
        cannot go on: `ranks` is empty, the report's rank writes `over`, every rank ends with
        the report's exit status, and the agents end whatever is left (a frozen worker too)
        instead of replacing anyone. `ranks` are places in this generation's group."""
        if not ranks:
            keys.post_over(self.store, "a hang report that names no member to remove")
            return
        for place in ranks:
            rank, life = self.members[place]
            keys.ask_removal(self.store, rank, life)
            debug(f"asked to remove rank {rank} (life {life}): the hang report named it")

    # -- waiting on the others ----------------------------------------------------------------
    def gone(self, rank: int, life: int) -> dict | None:
        """Why member (rank, life) is no longer in the job, or None if it still is: its agent
        saw it end (`left`), it said it raised (`raised`), or it finished (`done`)."""
        tag = f"{rank}.{life}"
        left = keys.read(self.store, f"left/{tag}")
        if left is None and not keys.has(self.store, f"done/{tag}"):
            return None
        why = dict(left or {"exitcode": 0, "done": True})
        raised = keys.read(self.store, f"raised/{tag}")
        if raised is not None:
            why["raised"] = raised
        return why

    def wait_for(self, what: str, ready) -> None:
        """Poll `ready()` until it is true, within the job's timeout (MembershipError)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not ready():
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"phalanx: rank {self.rank} waited {self.timeout.total_seconds():.0f} s for "
                    f"{what}; a member that is alive but stuck holds the job (see its stack), "
                    "or raise px.init(timeout=)")
            time.sleep(_POLL)

