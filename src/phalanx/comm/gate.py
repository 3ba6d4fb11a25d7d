"""The switch every collective reads under `--on-failure continue`: whether the step in flight
is already lost.

A leaf module (it imports only process.py, where the switch is kept with the rest of the
process's state), so that collectives.py and completion.py can read it. When a collective
fails because a peer is gone, the `Comm` or `Handle` that saw it calls `lost(exc)`; from then
until the survivors have formed their new group and reached the next step (membership.py),
`gate.cut` is True and every collective returns at once without touching the wire: the rest of
the step runs on this rank alone and is thrown away. Outside continue mode `gate.active` is
False and an error is raised as always.
"""

from __future__ import annotations

from ..world.process import state

__all__ = ["gate", "lost", "is_loss", "step_lost", "continuing"]

# The switch (process.py's Gate: active, cut, poked, on_loss), by the name its readers import:
# px.shutdown resets it in place, so this name stays the process's switch.
gate = state.gate


def step_lost() -> bool:
    """The one question the rest of phalanx asks continue mode: is the step in flight already
    lost (a peer gone, the wire cut)? What is computed or saved from then on is thrown away."""
    return gate.cut


def continuing() -> bool:
    """Whether this process runs under `--on-failure continue` (a collective's failure is then
    a loss to go on through, not an error): the one way phalanx asks it (comm/continuation.py
    re-exports it). A caller that only makes a call of continue mode need not ask: `now()`
    there answers as a job without it where it is off."""
    return gate.active


def is_loss(exc: BaseException) -> bool:
    """Whether `exc`, raised by a collective, means this generation's group is broken (a peer
    died, a connection closed, a peer's group was destroyed), as opposed to a mistake in the
    call that would fail the same way on a new group. Only asked in continue mode."""
    return gate.active and isinstance(exc, RuntimeError)


def lost(exc: BaseException) -> None:
    """A collective failed with `exc`: cut the wire for the rest of the step."""
    first = not gate.cut
    gate.cut = True
    if first and gate.on_loss is not None:
        gate.on_loss(exc)
