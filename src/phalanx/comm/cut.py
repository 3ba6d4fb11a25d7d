"""What a collective does on a broken group under `--on-failure continue`: the wrapper every
`Comm` method wears (collectives.py), and what each returns when nothing may touch the wire.
"""

from __future__ import annotations

import functools

from .completion import Handle
from .gate import gate, is_loss, lost

__all__ = ["guarded", "nothing", "own_shard"]


def guarded(cut):
    """[Note: a collective on a broken group]
    Under `--on-failure continue` (phalanx/continuing/) a collective that fails because a peer is
    gone does not raise: it cuts the wire for the rest of the step (comm/gate.py) and
    returns what `cut(self, *args, **kwargs)` gives, the result of a collective that moved
    nothing (this rank's own values); so does every collective while the wire is cut. The step
    is thrown away at `optimizer.step()`, where the survivors agree on what happened.
    Outside continue mode, and on a Comm over no group while the wire is whole, the method
    runs as written."""
    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            if not gate.active:
                return method(self, *args, **kwargs)
            # lost; or waiting for a group (continuing/); a Comm of a group made apart from the
            # job's one that ended with it is cut too: run as a world of one, zero3's gather
            # of a shard that is not the first copies onto itself and raises
            if gate.cut or self.waiting:
                return cut(self, *args, **kwargs)
            if self.group is None:
                return method(self, *args, **kwargs)
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                if not is_loss(exc):
                    raise
                lost(exc)
                return cut(self, *args, **kwargs)
        return guarded
    return wrap


def nothing(self, *args, async_op: bool = False, **kwargs):
    return Handle([]) if async_op else None


def own_shard(self, full, out, async_op: bool = True, tag=None):
    n = out.numel()
    out.copy_(full[self.rank * n:self.rank * n + n])
    return Handle([])
