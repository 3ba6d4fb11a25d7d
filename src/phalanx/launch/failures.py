"""From failed workers to the message the user reads.

The agent hands over one `ProcessFailure` per failed rank: exit code (negative for a signal),
local rank, and the worker's error file when it wrote one (worker.py writes it for a Python
exception or a non-zero `sys.exit`). For a worker that died without one (a native abort, a
signal, `os._exit`) the cause is read back from its stderr log instead.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal

from ..faults.hangs import HANG_EXIT
from ..world.leaving import how_it_ended
from .cleanup import describe

__all__ = ["failure_report", "restart_line", "attempt_summary", "survived_line", "native_cause"]

# Lines of a failed rank's traceback repeated in the final message (the whole traceback is
# already on stderr, prefixed with the rank).
TRACEBACK_LINES = 12

# Lines of a native crash's stderr that name its cause: a C++ exception that reached
# std::terminate (its type, then its `what()`), gloo's and c10's failed checks, and
# faulthandler's "Fatal Python error" when it says more than the signal's name.
_CAUSE = re.compile(
    r"terminate called|what\(\):|EnforceNotMet|enforce fail|collective mismatch"
    r"|uncaught exception of type"
    r"|Fatal Python error: (?!(Aborted|Segmentation fault|Bus error|Floating point exception"
    r"|Illegal instruction)\s*$)")
# The first line of a hang report (faults/hangs.py).
_HANG = re.compile(r"^phalanx: (hang |collectives out of order|a collective waited)")
_FOLLOWER = "ends: a hang was reported"
# What a rank says when a peer it waits for in a collective is gone or never comes.
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|[Tt]imed out"
                        r"|DistNetworkError")
# faulthandler's header of one thread's Python stack, and its frames.
_STACK_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ .*\(most recent call first\):")
_STACK_FRAME = re.compile(r'^\s+File "')
# Frames that are the launcher's, not the user's: runpy's and this package's worker.
_OWN_FRAME = re.compile(r'File "(<frozen runpy>|[^"]*[/\\]phalanx[/\\]launch[/\\][^"]*)"')


def failure_report(failures: dict, log_dir: str, earlier: list[str] = (),
                   endings: dict | None = None, survived: bool = False) -> str:
    """One message: the rank that failed first, or that hung or left early and so made the
    others fail, how it ended, the end of its traceback or of the report that named it, the
    others, and, after restarts, what ended each earlier attempt (`survived`: under
    `--on-failure continue`, `earlier` are the failures the job went on through). `endings`:
    global rank -> what the launcher did to end that worker ([Note: a worker the launcher
    ended])."""
    lead, first, culprits = _account(failures, log_dir, endings or {})
    rank, failure = first
    headline, lines = _failure_detail(failure, log_dir)
    text = f"phalanx run: error: {lead}"
    if rank in culprits:  # the lead is the first failure itself
        text += f": {headline}" if headline else ""
    else:  # the failure that the culprit caused, and what it said
        text += f"\n  | rank {rank} {how_it_ended(failure.exitcode)}"
        text += f": {headline}" if headline else ""
    text += "".join("\n  | " + line for line in lines)
    rest = [(r, f) for r, f in _ordered(failures, log_dir, endings or {})
            if r != rank and r not in culprits]
    also = [f"rank {r} ({how_it_ended(f.exitcode)})" for r, f in rest if not _stopped(f)]
    if also:
        text += "\n  also failed: " + ", ".join(also)
    halted = [str(r) for r, f in rest if _stopped(f)]
    if halted:
        text += f"\n  stopped: rank{'s' if len(halted) > 1 else ''} {', '.join(halted)}"
    if earlier and survived:
        text += (f"\n  before that, the job went on through {len(earlier)} failure"
                 f"{'s' if len(earlier) != 1 else ''}: " + "; ".join(earlier))
    elif earlier:
        total = len(earlier) + 1
        text += f"\n  that was attempt {total} of {total}; the earlier ones ended:"
        text += "".join(f"\n    attempt {i}: {summary}" for i, summary in enumerate(earlier, 1))
    return text


def restart_line(failures: dict, log_dir: str, attempt: int, attempts: int,
                 endings: dict | None = None) -> str:
    """The line printed when the agent restarts the workers: who failed, how, which attempt."""
    return (f"phalanx run: {attempt_summary(failures, log_dir, endings)}; restarting workers "
            f"(attempt {attempt} of {attempts})")


def attempt_summary(failures: dict, log_dir: str, endings: dict | None = None) -> str:
    """'rank 1 exited with code 3: sys.exit(3)': the first failure of one attempt, or the
    rank that hung or left early and made the others fail."""
    if not failures:
        return "the workers stopped answering (unhealthy)"
    lead, (rank, failure), culprits = _account(failures, log_dir, endings or {})
    if rank not in culprits:
        return lead
    headline, _ = _failure_detail(failure, log_dir)
    return lead + (f": {headline}" if headline else "")


def survived_line(survived: list[str]) -> str:
    """The last line of a `--on-failure continue` job that went on through failures."""
    n = len(survived)
    return (f"phalanx run: the job completed, going on through {n} failure"
            f"{'s' if n != 1 else ''}: " + "; ".join(survived))


def _account(failures: dict, log_dir: str, endings: dict) -> tuple[str, tuple, set]:
    """(the message's lead, the first failure (rank, ProcessFailure), the culprits' ranks).

    The first failure is the first rank that failed of its own accord. The lead names it,
    unless the job failed because a rank hung (the launcher found it frozen, or had to kill
    it: [Note: a worker the launcher ended]) or left early (its script had ended while the
    others waited for it in a collective: [Note: a script's end, for the launcher]): then
    the lead names that rank, and the first failure follows as what it caused."""
    ordered = _ordered(failures, log_dir, endings)
    rank, failure = ordered[0]
    hung = [r for r, f in ordered if r in endings and endings[r].hung]
    if hung:
        return f"rank {hung[0]} {describe(endings[hung[0]])}", ordered[0], set(hung)
    ended = _scripts_ended(failures, log_dir)
    if ended and rank not in ended and _waited_for_a_peer(failure, log_dir):
        hows = "; ".join(f"{'rank ' + str(r) + ': ' if len(ended) > 1 else ''}"
                         f"{_how_script_ended(ended[r])}" for r in sorted(ended))
        who = f"rank {min(ended)}" if len(ended) == 1 else \
            "ranks " + ", ".join(map(str, sorted(ended)))
        lead = f"{who} left early ({hows}), while the other ranks went on and waited for it"
        return lead, ordered[0], set(ended)
    return f"rank {rank} {how_it_ended(failure.exitcode)}", ordered[0], {rank}


def _how_script_ended(record: dict) -> str:
    """'the script called sys.exit(0) after 5 optimizer steps', from worker.py's record."""
    step = record.get("step")
    at = f" after {step} optimizer step{'s' if step != 1 else ''}" if step is not None else ""
    return f"{record.get('how', 'the script ended')}{at}"


def _waited_for_a_peer(failure, log_dir: str) -> bool:
    """Whether this failure is one of waiting for a peer: a hang report, or a lost connection
    or a timeout in a collective."""
    if failure.exitcode == HANG_EXIT:
        return True
    headline, lines = _failure_detail(failure, log_dir)
    return any(_LOST_PEER.search(line) for line in [headline, *lines])


def _scripts_ended(failures: dict, log_dir: str) -> dict[int, dict]:
    """Global rank -> how its script ended, for every worker of this node whose script had
    ended well by the time of the failures (worker.py's `ended.json`), failed since or not."""
    ended = {}
    for rank, failure in failures.items():
        stderr = _stderr_log(failure, log_dir)  # in the attempt's folder, beside the others'
        if stderr is None:
            continue
        attempt = os.path.dirname(os.path.dirname(stderr))
        offset = rank - failure.local_rank  # global ranks are numbered node by node
        for path in glob.glob(os.path.join(glob.escape(attempt), "*", "ended.json")):
            try:
                with open(path) as f:
                    ended[offset + int(os.path.basename(os.path.dirname(path)))] = json.load(f)
            except (OSError, ValueError):
                continue
        break
    return ended


def native_cause(stderr: str) -> tuple[str, list[str]]:
    """The cause of a native crash from the worker's stderr: (headline, lines to show).

    Python prints nothing useful for a process that aborts in C++; what names the cause is the
    runtime's "terminate called after throwing an instance of 'gloo::EnforceNotMet'" and the
    exception's "what(): ... Is there a distributed collective mismatch in your code?", which
    come before faulthandler's stacks and its long "Extension modules:" line. The headline is
    the first such line, the lines are the others, then one Python stack without the
    launcher's frames. With no cause line, the end of stderr without the module list.
    """
    lines = stderr.rstrip().splitlines()
    hang = next((i for i, line in enumerate(lines) if _HANG.match(line)), None)
    if hang is not None:  # the hang report of faults/hangs.py: its headline and rank lines
        rest = [line for line in lines[hang + 1:] if line.startswith("  rank ")]
        return lines[hang].removeprefix("phalanx: "), rest
    causes = list(dict.fromkeys(line.strip() for line in lines if _CAUSE.search(line)))
    stack = _python_stack(lines)
    if not causes and not stack:
        kept = [line for line in lines if not line.startswith("Extension modules:")]
        return "", kept[-TRACEBACK_LINES:]
    headline, rest = (causes[0], causes[1:]) if causes else ("", [])
    if any("collective mismatch" in line for line in causes):
        rest.append("run again with PHALANX_CHECK_COLLECTIVES=1 to have every collective "
                    "checked before it is issued and the one each rank issues named")
    room = max(TRACEBACK_LINES - len(rest), 4)
    return headline, rest + stack[:room]


def _python_stack(lines: list[str]) -> list[str]:
    """The stack faulthandler printed for the crashing thread (or, when the crash came from a
    thread without Python, for the main thread, which it lists last), without the launcher's
    frames."""
    blocks, block = [], None
    for line in lines:
        if _STACK_HEADER.match(line):
            block = [line]
            blocks.append(block)
        elif block is not None and _STACK_FRAME.match(line):
            block.append(line)
        else:
            block = None  # a block is its header and the frame lines right after it
    if not blocks:
        return []
    current = [b for b in blocks if b[0].startswith("Current thread")]
    header, *frames = (current or blocks[-1:])[0]
    return [header] + [f for f in frames if not _OWN_FRAME.search(f)]


def _stopped(failure) -> bool:
    return failure.exitcode == -signal.SIGTERM


def _ordered(failures: dict, log_dir: str, endings: dict | None = None) -> list:
    """Failed ranks, first failure first.

    The agent knows every failed rank but orders them by a timestamp in whole seconds, and it
    counts the ranks it ended itself as failures too. The first failure is found here from the
    worker's own error file (a precise time, written by worker.py), or for a rank that died
    without one (a signal, os._exit) from when its stderr was last written; the ranks that
    ended because another reported a hang come after, and those the agent ended itself last
    (SIGTERM to the survivors, and a SIGKILL of its own: `endings`).
    """
    endings = endings or {}
    return sorted(failures.items(), key=lambda item: (
        _stopped(item[1]) or bool(item[0] in endings and endings[item[0]].hung),
        _ended_by_report(item[1], log_dir), _failure_time(item[1], log_dir), item[0]))


def _ended_by_report(failure, log_dir: str) -> bool:
    """A rank that ended because another rank reported a hang (the reporter comes first)."""
    if failure.exitcode != HANG_EXIT:
        return False
    path = _stderr_log(failure, log_dir)
    if not path:
        return False
    with open(path, errors="replace") as f:
        return _FOLLOWER in f.read()


def _error_info(failure) -> dict:
    message = (failure.error_file_data or {}).get("message")
    return message if isinstance(message, dict) else {}


def _stderr_log(failure, log_dir: str) -> str | None:
    """The newest stderr log of this local rank (the agent keeps one per restart attempt)."""
    pattern = os.path.join(glob.escape(log_dir), "*", "attempt_*", str(failure.local_rank),
                           "stderr.log")
    paths = glob.glob(pattern)
    return max(paths, key=os.path.getmtime) if paths else None


def _failure_time(failure, log_dir: str) -> float:
    precise = _error_info(failure).get("extraInfo", {}).get("time")
    if precise is not None:
        return float(precise)
    path = _stderr_log(failure, log_dir)
    return os.path.getmtime(path) if path else float(failure.timestamp)


def _failure_detail(failure, log_dir: str) -> tuple[str, list[str]]:
    """The failure's one-line cause and the last lines of its traceback (or of its stderr)."""
    info = _error_info(failure)
    headline = (str(info.get("message", "")).strip().splitlines() or [""])[0]
    callstack = info.get("extraInfo", {}).get("py_callstack", "")
    if callstack.strip():
        return headline, callstack.rstrip().splitlines()[-TRACEBACK_LINES:]
    path = _stderr_log(failure, log_dir)
    if not path:
        return headline, []
    with open(path, errors="replace") as f:
        cause, lines = native_cause(f.read())
    return headline or cause, lines
