"""What a `phalanx run` job leaves behind once its launcher has exited: the leftover checks of
benchmarks/fault_soak.py.

A job is started with a marker in its environment (`PHALANX_SOAK_JOB=<token>`), which every
process it starts inherits (its agent runs inside the launcher; the workers, replacements and
any process a worker starts), and the token in its command line (its checkpoint directory).
While it runs, `Watch` polls /proc for those processes and notes their process groups (torch's
agent starts each worker in a session of its own) and every /dev/shm file any of them holds
open or mapped. Once the launcher has exited, `Watch.leftovers` lists:

- processes: any of them (by marker, command line or process group) still there (a zombie,
  already ended, is not) a short grace after the launcher's exit; they are then killed;
- temporary files: anything in the job's own TMPDIR (the launcher's log directory, torch's
  elastic files, whatever a worker made through `tempfile`), but torch's per-user compile
  cache (`torchinductor_<user>`, which the first optimizer step of any torch program makes
  there and torch keeps between runs on purpose), and any save left half done (`*.partial-*`,
  `*.old-*`) under its checkpoint directory;
- shared memory: /dev/shm entries made while the job ran and still there, that a process of the
  job held or that carry one of its pids in their name (what torch names its segments after).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

MARKER = "PHALANX_SOAK_JOB"
SHM = Path("/dev/shm")
TORCH_CACHE = re.compile(r"torchinductor_.+")  # torch's own, kept between runs
GRACE = 3.0   # seconds a process of the job may take to end after the launcher's exit


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _stat(pid: str) -> tuple[str, int] | None:
    """(state, process group) of `pid`, or None when it is gone."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text.decode(errors="replace").rsplit(")", 1)[1].split()
    return fields[0], int(fields[2])


def job_processes(token: str, groups: set[int] = frozenset()) -> dict[int, str]:
    """pid -> command line of every live process (not a zombie) that carries `token` in its
    environment's marker or its command line, or that is in one of `groups`."""
    marker = f"{MARKER}={token}".encode()
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(pid)
        if stat is None or stat[0] == "Z" or int(pid) == os.getpid():
            continue
        cmdline = _read(f"/proc/{pid}/cmdline") or b""
        environ = _read(f"/proc/{pid}/environ") or b""
        if token.encode() in cmdline or marker in environ.split(b"\0") or stat[1] in groups:
            found[int(pid)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def shm_held(pid: int) -> set[str]:
    """The /dev/shm entries `pid` has open or mapped."""
    held = set()
    for line in (_read(f"/proc/{pid}/maps") or b"").decode(errors="replace").splitlines():
        if "/dev/shm/" in line:
            held.add(line.split("/dev/shm/", 1)[1].split()[0])
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                held.add(target[len("/dev/shm/"):].split(" (deleted)")[0])
    except OSError:
        pass
    return held


class Watch:
    """Polls the processes of the job `token` every `every` seconds until `stop()`."""

    def __init__(self, token: str, every: float = 0.2):
        self.token = token
        self.pids: set[int] = set()
        self.groups: set[int] = set()
        self.shm: set[str] = set()
        self.shm_before = set(os.listdir(SHM)) if SHM.is_dir() else set()
        self._done = threading.Event()
        self._every = every
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.is_set():
            self.look()
            self._done.wait(self._every)

    def look(self) -> None:
        for pid in job_processes(self.token):
            self.pids.add(pid)
            stat = _stat(str(pid))
            if stat is not None and stat[1] != os.getpgrp():
                self.groups.add(stat[1])
            self.shm |= shm_held(pid)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def leftovers(self, tmpdir: Path, ckpt: Path) -> dict[str, list[str]]:
        """What the job left, by kind (see the module's docstring); kills leftover processes."""
        self.stop()
        deadline = time.monotonic() + GRACE
        while (alive := job_processes(self.token, self.groups)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        temporary = sorted(str(p.relative_to(tmpdir)) for p in tmpdir.iterdir()
                           if not TORCH_CACHE.fullmatch(p.name)) if tmpdir.is_dir() else []
        if ckpt.is_dir():
            temporary += sorted(str(p) for p in ckpt.rglob("*")
                                if re.search(r"\.(partial|old)-", p.name))
        pids = {str(p) for p in self.pids}
        now = set(os.listdir(SHM)) if SHM.is_dir() else set()
        shm = sorted(name for name in now - self.shm_before
                     if name in self.shm or pids & set(re.findall(r"\d+", name)))
        return {"processes": [f"{pid} ({_stat(str(pid)) or 'gone'}): {cmd}"
                              for pid, cmd in alive.items()],
                "temporary": temporary, "shared memory": shm}
