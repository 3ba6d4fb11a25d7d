"""The keys that the agents and the workers of a `--on-failure continue` job share in the
job's store (the agent's TCP store on node 0, which outlives every worker).

Under the prefix `phalanx/continuing/`:

    alive/<node>             workers of that node running now, and finished (its agent)
    left/<rank>.<life>       written by the agent when that worker ended with an error:
                             exit code and time (`life` 0 is the first worker of the rank,
                             1 its first replacement, ...)
    raised/<rank>.<life>     written by the worker itself before it ends on an exception:
                             the optimizer step call it was in and the message
    done/<rank>.<life>       the worker reached px.shutdown: nobody waits for it any more
    remove/<rank>.<life>     a hang report named that worker: its agent ends it (and then
                             writes `left/`, saying it removed it)
    over                     the job cannot go on (a MembershipError, a hang report that
                             names nobody to remove): the agents replace nobody and end
                             whatever is left
    notices                  a count of the two above: an agent looks at it once per
                             monitoring tick, and at them only when it has changed
    gen                      the newest generation (a group of members; 0 at the start)
    gen<g>/members           pickled sorted list of the members' ranks
    gen<g>/report/<rank>     a member's report in the recovery from generation g
    gen<g>/pg/...            the process group of generation g (torch's own keys)
    join/<rank>.<life>       a replacement waiting to be admitted
    admitted/<g>             what a replacement admitted into generation g loads

Values are pickles; `get` is only called on a key that `check` found, so nothing here blocks
on a key that will never come.
"""

from __future__ import annotations

import pickle

from torch.distributed import PrefixStore

__all__ = ["keyspace", "set_alive", "alive_total", "post_left", "read", "write", "has",
           "ask_removal", "removal_asked", "post_over", "over", "notices"]

PREFIX = "phalanx/continuing"


def keyspace(store) -> PrefixStore:
    return PrefixStore(PREFIX, store)


def write(store, key: str, value) -> None:
    store.set(key, pickle.dumps(value))


def has(store, key: str) -> bool:
    return store.check([key])


def read(store, key: str, default=None):
    """The value under `key`, or `default` when there is none (never blocks)."""
    if not store.check([key]):
        return default
    return pickle.loads(store.get(key))


def set_alive(store, node: int, running: int, finished: int) -> None:
    """This node's workers running now, and those that finished (exited 0) so far."""
    write(store, f"alive/{node}", (running, finished))


def alive_total(store, nodes: int) -> tuple[int, int]:
    """(running, finished) over all `nodes` nodes (a node that has not said yet: one running)."""
    counts = [read(store, f"alive/{node}", (1, 0)) for node in range(nodes)]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def post_left(store, rank: int, life: int, exitcode: int, when: float, **more) -> None:
    """The agent saw the worker end with an error; `more`: `removed` (it ended it, as a hang
    report asked) and `frozen` (its process was stopped then)."""
    write(store, f"left/{rank}.{life}", {"exitcode": exitcode, "time": when, **more})


def ask_removal(store, rank: int, life: int) -> None:
    write(store, f"remove/{rank}.{life}", True)
    store.add("notices", 1)


def removal_asked(store, rank: int, life: int) -> bool:
    return has(store, f"remove/{rank}.{life}")


def post_over(store, why: str) -> None:
    """The job cannot go on: no agent replaces a worker any more (launch/continuing.py)."""
    write(store, "over", why)
    store.add("notices", 1)


def notices(store) -> int:
    """How many removals and `over` were posted so far (one call, whatever the job's size)."""
    return store.add("notices", 0)


def over(store) -> str | None:
    return read(store, "over")
