"""What the launcher itself did to end a worker, so that its message does not blame a signal the
launcher sent.

[Note: a worker the launcher ended]
When one worker fails, torch's agent ends the others of its node: SIGTERM to each worker's
process group, then, to those still there after 30 s, SIGKILL. A worker's exit status alone
cannot tell that SIGKILL from a kill by someone else (the out-of-memory killer, a user), and
the report used to read "rank 1 was killed by SIGKILL" for a rank that had hung and that the
launcher had killed itself. So every signal the agent sends a worker is noted here, with the
state the worker's process was in: a worker that was frozen (stopped by SIGSTOP, or by a
debugger's job control) is one that hung, and one that needed SIGKILL had not ended within
30 s of SIGTERM: stuck, in native code or the kernel, or ignoring SIGTERM. Both lead the
message as the rank that hung (launch/failures.py).

A frozen worker gets SIGCONT right after its signal, so that it receives it now rather than
after 30 s, and is never left behind stopped.

Under `--on-failure continue` the agent also ends a worker that a hang report named, as the
report asked ([Note: a member that hangs] in continuing/membership.py): with SIGKILL, which a
frozen process receives too. Its `Ending` says it was removed, and the message says so.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field

__all__ = ["Ending", "note_signals", "describe"]

SIGTERM_GRACE = 30  # seconds torch's agent waits after SIGTERM before SIGKILL


@dataclass
class Ending:
    """How the launcher ended one worker: the signals it sent, and whether the worker's
    process was frozen (stopped) when it came to end it."""

    signals: list[str] = field(default_factory=list)
    frozen: bool = False
    removed: bool = False  # a hang report named it, and the agent ended it (continuing.py)

    @property
    def hung(self) -> bool:
        return self.frozen or "SIGKILL" in self.signals


def _state(pid: int) -> str | None:
    """The process's state letter from /proc ("T": stopped by a signal), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def note_signals(handler, ending: Ending) -> None:
    """Have every signal the agent sends through `handler` (torch's SubprocessHandler: its
    `close(death_sig)`) noted in `ending`, and a frozen worker continued to receive it."""
    close = handler.close

    def noting_close(death_sig=None):
        pid = handler.proc.pid
        frozen = handler.proc.poll() is None and _state(pid) == "T"
        ending.frozen = ending.frozen or frozen
        ending.signals.append(getattr(death_sig, "name", None) or "SIGTERM")
        close(death_sig)
        if frozen:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGCONT)

    handler.close = noting_close


def describe(ending: Ending) -> str:
    """How a hung worker ended, for the message: 'hung (its process was frozen: stopped by
    SIGSTOP), and the launcher ended it'."""
    if ending.removed:
        why = ("its process was frozen (stopped, as by SIGSTOP)" if ending.frozen else
               "it had not entered the collective its peers waited in")
        return f"hung: {why}; the hang report named it, and the launcher removed it"
    if ending.frozen:
        return ("hung: its process was frozen (stopped, as by SIGSTOP), and the launcher "
                "ended it")
    return (f"hung: it did not end within {SIGTERM_GRACE} s of the launcher's SIGTERM (stuck "
            "in native code, or ignoring SIGTERM), and the launcher killed it (SIGKILL)")
