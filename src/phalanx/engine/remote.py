"""One rank reads its peers' shards on its own: each rank serves what it holds from a thread.

[Note: reading a peer's shards]
Under zero1, zero2 and zero3 a rank holds 1/N of the masters and of the optimizer state (and
under zero3 of the parameters), so the full state, or a forward with full parameters, needs
the other ranks' shards. A collective would need every rank to call it at the same moment,
and real scripts do these things on one rank only (nanoGPT evaluates and saves inside
`if master_process:`, Hugging Face users `generate` on the main process). Here no rank has to
take part: each rank runs a `ShardService` thread that serves its shards to a peer that asks.

- Requests travel through the job's rendezvous store, over connections of the service's own
  (a store client serialises its calls, so a server blocked in a wait on the job's client would
  stall every other user of it: the hang watcher, the creation of groups). The asking rank
  takes a ticket from the serving rank's counter (an atomic add) and writes its request under
  that ticket; the server thread waits for its tickets in order. The answer's header (what
  comes, or an error) goes back through the store, and the tensors over a gloo channel of the
  service's own, point to point, on the CPU (a GPU rank copies its shard out first). No other
  rank, and no other group, is involved. The channel is a gloo group made outside torch's
  registry of groups, so torch's `destroy_process_group()`, which ends every group it lists
  and which torch DDP scripts call last, leaves it working: a rank that has called it still
  answers until its end ([Note: a rank's end] in leaving.py).
- The values are consistent: a request names how many optimizer steps the asking rank has
  taken with that model, and the server waits until its model has taken as many before it
  reads, under the masters' lock (engine/state.py's `Masters`), which `optimizer.step()` holds
  while it changes masters and optimizer state and while it counts the step. A peer cannot
  step past the asking rank: its next step needs the asking rank's gradients (a collective)
  and, under zero3, its next forward the asking rank's gathers. A peer already past it (the
  asking rank acts between its backward and its step while the peers stepped) cannot give the
  old values, and the asking rank gets an error saying when to call instead.
- A peer that does not answer within the job's timeout (`px.init(timeout=)`): the asking rank
  raises `PeerError` naming the peer and what it asked for. Under `phalanx run --on-failure
  continue` a peer that died never answers, and neither does a survivor that has given up
  the group (its service ended with it): so the wait looks at the store every few
  milliseconds and at the members every `_LOOK` seconds, and ends as soon as a member of the
  generation is known gone (continuing/membership.py's `gone`), not at the timeout, with a
  `PeerError` marked `gone`. A forward reading shards counts that as a loss of the step
  (engine/state.py's `fetch_unit`).
- While nobody asks, the thread is blocked in one wait on the store: nothing is sent, nothing
  is held, no CPU is used. `px.shutdown()` (which the end of a script calls) ends it once every
  peer has reached its own end, so a peer may read shards until then (leaving.py).

[Note: a model dropped while a peer reads it]
Every rank may call `state_dict()` and return (a function's model goes with it) while a slower
peer still reads this rank's shards of that model. So the service holds each model's masters
(engine/state.py's `Masters`, which keeps its engine) itself, and when the user's prepared
model is gone it keeps the engine until a blocking collective on the job's group, issued after
that, has returned on this rank: every peer has then issued it, so every peer's main thread is
past its reads (they are synchronous). A dropped model is therefore freed at the next blocking
collective (a barrier, the next `px.prepare`, a buffer broadcast or roots check of the next
forward, clipping) or at `px.shutdown()`, not at the moment it is dropped.

[Note: served once prepared]
A rank returns from `px.prepare` and may read its peers' shards at once (`state_dict()` right
after it), while a peer is still inside its own `px.prepare`: before its engine is registered
(it answered 'no prepared model number 0'), or with its masters not yet holding their values
(a meta build's are drawn after the engine exists, model/materialize.py: it answered the zeros
they start from). So an engine is served only once `open` says its prepared model exists
(prepared.py), and a request for one not open yet waits for it, as it waits for a step, within
the timeout: models are prepared in one order on every rank, so the one asked for is coming.
"""

from __future__ import annotations

import datetime
import pickle
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from ..comm import continuation, groups, records
from ..comm.collectives import JobEnded
from ..comm.gate import step_lost
from ..world.process import state

__all__ = ["ShardService", "service_for", "PeerError", "stop_all"]

_KEY = "phalanx/service"
_STOP = b"stop"
_IDLE_WAIT = datetime.timedelta(days=7)  # a wait that never times out while the job lives
_LOOK = 0.05  # --on-failure continue: seconds between two looks at the members while waiting


class PeerError(RuntimeError):
    """A peer did not answer a request for its shards, or answered that it could not."""

    gone = False  # continue mode: a member of the generation left; the answer will not come


def _gone(message: str) -> PeerError:
    """A PeerError that says the generation lost a member (see [Note: reading a peer's
    shards]): a forward under continue mode takes it as a loss of the step."""
    error = PeerError(message)
    error.gone = True
    return error


def _connect(store, timeout: float):
    """A client connection of our own to the job's store (see the Note); the store itself where
    it is not a TCP store (a file or hash store: their calls do not block one another)."""
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))
    return store


class ShardService:
    """This process's server of shards, and its requests to the peers' (see the Note)."""

    def __init__(self, group, rank: int, world: int):
        self.rank, self.world = rank, world
        timeout = groups.timeout()
        self.timeout = timeout.total_seconds() if timeout is not None else 600.0
        store = dist.distributed_c10d._get_default_store()
        self._serving_store = _connect(store, self.timeout)
        self._asking_store = _connect(store, self.timeout)
        # A key space per px.init: a store that outlives a shutdown and a new init (or a
        # launcher's restart) has the old tickets in it.
        # shard_size: one service per shard group, each with keys of its own (hybrid.py)
        ranks = dist.get_process_group_ranks(group)
        key = _KEY if world == dist.get_world_size() else \
            f"{_KEY}/ranks {','.join(map(str, ranks))}"
        gen = continuation.now().generation()  # --on-failure continue: each its own keys
        if gen is not None:
            key = f"{key}/gen{gen}"
        attempt = (self._asking_store.add(f"{key}/joined", 1) - 1) // world
        self.prefix = f"{key}/{attempt}"
        # Outside torch's registry (see the Note), bounded by the job's timeout; its ranks are
        # the service's (ranks of `group`). Made by every rank of `group`, as the service is.
        self.channel = dist.ProcessGroupGloo(dist.PrefixStore(f"{self.prefix}/channel", store),
                                             rank, world, datetime.timedelta(seconds=self.timeout))
        self.parent = group
        self.engines: list = []  # weak references, by the order models were prepared
        self._held: dict[int, object] = {}   # engine id -> the engine, while its model lives
        self._open = threading.Condition()   # guards `opened`; notified by `open`
        self.opened = 0  # engines 0 .. opened-1 are served (see [Note: served once prepared])
        self._retired: list = []             # (engine, blocking collectives done when retired)
        self.served = 0          # requests answered (tests, benchmarks)
        self.stopped = False     # `stop` ran: this rank's end, after every peer's (leaving.py)
        records.on_blocking_done(self._release)
        self._thread = threading.Thread(target=self._serve, name="phalanx-shard-service",
                                        daemon=True)
        self._thread.start()

    def register(self, engine) -> int:
        """The engine's number: the same on every rank (models are prepared in one order). The
        engine is held until `retire` (see [Note: a model dropped while a peer reads it])."""
        self.engines.append(weakref.ref(engine))
        self._held[len(self.engines) - 1] = engine
        return len(self.engines) - 1

    def open(self, engine_id: int) -> None:
        """Engine `engine_id`'s prepared model exists: serve it (and every engine before it,
        see [Note: served once prepared])."""
        with self._open:
            self.opened = max(self.opened, engine_id + 1)
            self._open.notify_all()

    def retire(self, engine_id: int) -> None:
        """The user's prepared model of engine `engine_id` is gone: keep the engine until a
        later blocking collective on the job's group has returned (see the Note)."""
        engine = self._held.pop(engine_id, None)
        if engine is not None:
            self._retired.append((engine, records.blocking_done(self.parent)))

    def _release(self, group) -> None:
        """After a blocking collective on `group` returned: free what was retired before it."""
        if self._retired and group is self.parent:
            done = records.blocking_done(group)
            self._retired = [(e, mark) for e, mark in self._retired if mark >= done]

    def stop(self) -> None:
        """End the serving thread (a request to itself that says stop: it answers in order)
        and the channel, whose connections close, so a peer still waiting on this rank fails
        at once; let go of every engine."""
        self._held.clear()
        self._retired = []
        self.stopped = True
        try:
            if self._thread.is_alive():
                ticket = self._asking_store.add(f"{self.prefix}/{self.rank}/tickets", 1)
                self._asking_store.set(f"{self.prefix}/{self.rank}/request/{ticket}", _STOP)
                if self._thread is not threading.current_thread():
                    self._thread.join(timeout=5)
        except Exception:  # noqa: BLE001 - the store is gone: the thread ends by itself
            pass
        finally:
            channel, self.channel, self.parent = self.channel, None, None
            if channel is not None and not self._thread.is_alive():
                channel.shutdown()

    # -- asking ---------------------------------------------------------------------------
    def ask(self, peers: list[int], engine_id: int, kind: str, arg, step: int, what: str):
        """Ask each rank of `peers` (ranks of the group) for `kind`/`arg` of engine `engine_id`
        once it has taken `step` optimizer steps: every request is made first, so the peers
        read and answer at once; returns [(header, tensors)] in the order of `peers`.

        After this rank's end (`stop`, at px.shutdown() once every peer has reached its own
        end: leaving.py) nobody serves any more: `JobEnded` at once, where a request would
        wait for an answer that never comes."""
        if self.stopped and step_lost():
            raise continuation.MembershipError(
                f"phalanx: this rank asked a peer for {what} after a rank was lost and before "
                "the survivors recovered (phalanx run --on-failure continue): the lost rank's "
                "shard of the model's state is nowhere but in a checkpoint, which the survivors "
                "load at their next step, redoing the steps after it; past the loop's last "
                "step there is none. The job ends here rather than give a state an "
                "uninterrupted run would not have: resume from the newest checkpoint")
        if self.stopped:
            raise JobEnded(f"this rank asked a peer for {what} after every rank had reached "
                           "its end (px.shutdown() or torch's destroy_process_group()): the "
                           "peers holding the other shards have ended. Take the state "
                           "(state_dict(), optimizer.state_dict(), a forward) before the end")
        store = self._asking_store
        tickets = []
        for peer in peers:
            ticket = store.add(f"{self.prefix}/{peer}/tickets", 1)
            store.set(f"{self.prefix}/{peer}/request/{ticket}",
                      pickle.dumps((self.rank, engine_id, kind, arg, step)))
            tickets.append(ticket)
        return [self._receive(peer, ticket, what) for peer, ticket in zip(peers, tickets)]

    def _receive(self, peer: int, ticket: int, what: str):
        store = self._asking_store
        answer = f"{self.prefix}/{peer}/answer/{ticket}"
        try:
            self._wait(answer, peer, what)
            header = pickle.loads(store.get(answer))
        except (RuntimeError, ValueError) as exc:
            if getattr(exc, "gone", False):
                raise
            raise PeerError(f"rank {peer} did not answer within {self.timeout:.0f} s when asked "
                            f"for {what} (its process may have ended, or be stuck outside "
                            f"Python; px.init(timeout=) sets the wait): "
                            f"{type(exc).__name__}") from None
        store.delete_key(answer)
        if "error" in header:
            raise PeerError(f"rank {peer} could not give {what}: {header['error']}")
        tensors = []
        for shape, dtype in header["tensors"]:
            buf = torch.empty(shape, dtype=dtype)
            try:
                self.channel.recv([buf], peer, ticket % 2**20).wait()
            except (RuntimeError, AttributeError) as exc:  # AttributeError: stopped meanwhile
                error = _gone if continuation.continuing() else PeerError
                raise error(f"rank {peer} went away while sending {what}: {exc}") from None
            tensors.append(buf)
        return header, tensors

    def _wait(self, key: str, peer: int, what: str) -> None:
        """Until the answer `key` is in the store, within the timeout (a RuntimeError after
        it); under continue mode a PeerError marked `gone` once a member is known gone (see
        the Note)."""
        store = self._asking_store
        if not continuation.continuing():
            store.wait([key], datetime.timedelta(seconds=self.timeout))
            return
        began = looked = time.monotonic()
        pause = 0.0005
        while not store.check([key]):  # a wait that times out in slices warns at each slice
            now = time.monotonic()
            if now - began > self.timeout:
                raise RuntimeError(f"no answer within {self.timeout:.0f} s")
            if now - looked > _LOOK:
                looked = now
                rank = continuation.now().member_gone()
                if rank is not None:
                    raise _gone(f"rank {peer} cannot give {what}: launch rank {rank} "
                                "has left the job")
            time.sleep(pause)
            pause = min(2 * pause, 0.005)

    # -- serving --------------------------------------------------------------------------
    def _serve(self) -> None:
        store, ticket, warned = self._serving_store, 1, False
        while True:
            key = f"{self.prefix}/{self.rank}/request/{ticket}"
            try:
                store.wait([key], _IDLE_WAIT)
                request = store.get(key)
                store.delete_key(key)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return
            if request == _STOP:
                return
            asker, engine_id, kind, arg, step = pickle.loads(request)
            try:
                header, tensors = self._answer(engine_id, kind, arg, step)
            except Exception as exc:  # noqa: BLE001 - told to the asking rank
                header, tensors = {"error": f"{type(exc).__name__}: {exc}"}, []
            header["tensors"] = [(tuple(t.shape), t.dtype) for t in tensors]
            try:
                self.served += 1  # before the answer: the asking rank may read it next
                store.set(f"{self.prefix}/{self.rank}/answer/{ticket}", pickle.dumps(header))
                for t in tensors:
                    self.channel.send([t], asker, ticket % 2**20).wait()
            except Exception as exc:  # noqa: BLE001 - the asking rank went away
                if not warned:
                    warned = True
                    print(f"phalanx: rank {self.rank}: a peer's request for shards failed: "
                          f"{exc}", file=sys.stderr, flush=True)
            ticket += 1

    def _answer(self, engine_id: int, kind: str, arg, step: int):
        deadline = time.monotonic() + self.timeout
        with self._open:  # see [Note: served once prepared]
            if not self._open.wait_for(lambda: engine_id < self.opened, timeout=self.timeout):
                raise RuntimeError(f"this rank did not finish preparing model number "
                                   f"{engine_id} within {self.timeout:.0f} s (is px.prepare "
                                   "called for the same models in the same order on every "
                                   "rank?)")
        engine = self.engines[engine_id]()
        if engine is None:
            raise RuntimeError(f"no prepared model number {engine_id} on this rank")
        # the masters are asked for at their own version: a step that moved none (a new
        # optimizer's state made at learning rate 0, engine/stepping.py) does not count there
        def version() -> int:
            return engine.masters_version if kind == "master" else engine.version
        while version() < step:  # see the Note: wait for this rank's step
            if time.monotonic() > deadline:
                raise RuntimeError(f"this rank has taken {version()} optimizer steps and "
                                   f"did not reach step {step} within {self.timeout:.0f} s")
            time.sleep(0.001)
        with engine.lock:
            if version() != step:
                raise RuntimeError(
                    f"this rank has taken {version()} optimizer steps and the asking rank "
                    f"{step}: ask between optimizer.step() and the next backward (a peer may "
                    "step while the asking rank is between its backward and its step)")
            return engine.serve(kind, arg)


def service_for(comm) -> ShardService | None:
    """The process's shard service over `comm`'s group (made the first time: a collective of
    its ranks); None in a world of one."""
    if comm.group is None or comm.world == 1:
        return None
    services = state.services
    entry = services.get(id(comm.group))
    if entry is None or entry[0] is not comm.group:
        entry = services[id(comm.group)] = (comm.group, ShardService(comm.group, comm.rank,
                                                                    comm.world))
        groups.on_end(stop_all)
    return entry[1]


def stop_all() -> None:
    """End every service (`px.shutdown()`, once every peer has reached its end, before the
    groups end; a generation's end under --on-failure continue)."""
    entries, _ = list(state.services.values()), state.services.clear()
    for _, service in entries:
        service.stop()
