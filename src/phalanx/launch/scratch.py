"""A launcher's temporary directory: locked while its launcher lives, removed by the next one
when its launcher was killed.

[Note: a launcher's temporary directory]
`phalanx run` keeps each worker's stdout, stderr and error file in `$TMPDIR/phalanx-run-*`, and
`px.spawn` its workers' stacks and file store in `$TMPDIR/phalanx-workers-*`; each removes its
own when it ends, also on Ctrl-C or SIGTERM. One killed with SIGKILL (the out-of-memory killer,
a scheduler's hard kill) cannot, and its directory would stay until the machine is cleaned. So
the next launcher of the same kind on the machine removes it before it makes its own; it must
never remove the directory of a launcher still running beside it (another job of the same
user), whose workers write there.

What tells the two apart is a lock, not a pid: each launcher holds an exclusive flock(2) on
`launcher.lock` in its directory for as long as it lives, and the kernel releases it however
the process ends, so a directory whose lock can be taken belongs to a launcher that is gone. (A
pid checked with kill(pid, 0) may belong to another process by then, and a launcher in another
container sharing the same /tmp has a pid this one cannot see.) The lock file appears already
locked: it is made under another name, locked, then renamed into place, so a launcher starting
at that moment never finds it unlocked. A directory without `launcher.lock` (being made this
instant, or left by an older phalanx) is left alone, as is another user's. The file holds the
launcher's pid and host name, for a person who looks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import stat
import tempfile

__all__ = ["make", "remove"]

_LOCK = "launcher.lock"


def make(prefix: str) -> tuple[str, int | None]:
    """Remove what killed launchers left under `prefix`, then make this launcher's directory
    and lock it: (its path, the lock's file descriptor, kept open until `remove`; None where
    the file system takes no lock, and then no other launcher ever removes the directory)."""
    _remove_abandoned(tempfile.gettempdir(), prefix)
    path = tempfile.mkdtemp(prefix=prefix)
    return path, _lock(path)


def remove(path: str, fd: int | None) -> None:
    """The launcher's own directory, at its end, then its lock (held until the directory is
    gone, so that no other launcher removes it meanwhile)."""
    shutil.rmtree(path, ignore_errors=True)
    if fd is not None:
        os.close(fd)


def _remove_abandoned(root: str, prefix: str) -> None:
    """Remove each `prefix*` directory of this user in `root` whose launcher is gone."""
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue  # a link, a file, or another user's
            fd = os.open(os.path.join(path, _LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or no lock: being made, or an older phalanx's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its launcher is running
            os.close(fd)
            continue
        shutil.rmtree(path, ignore_errors=True)  # under the lock: no other launcher races
        os.close(fd)


def _lock(path: str) -> int | None:
    """Take the lock of the directory `path`, made under another name and renamed into place
    locked (see the Note)."""
    making = os.path.join(path, _LOCK + ".new")
    fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without locks: the directory is never another's to remove
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(making)
        return None
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    os.rename(making, os.path.join(path, _LOCK))
    return fd
