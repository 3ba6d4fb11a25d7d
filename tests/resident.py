"""A process's resident memory as a user sees it (Linux's /proc/self), for the tests that bound
what an operation adds: the resident set, its high-water mark, and resetting that mark."""

from __future__ import annotations

import contextlib
import ctypes
import gc


def status(key: str) -> int:
    """Bytes of `key` in /proc/self/status: "VmRSS" (resident now) or "VmHWM" (its peak)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key + ":")).split()[1]) * 1024


def reset_peak() -> None:
    """The high-water mark (VmHWM) becomes the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def trim() -> None:
    """Give the heap's free memory back to the system, so that what an operation allocates
    shows as a rise of the resident set rather than reusing pages already counted."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_rise(fn) -> int:
    """Bytes the peak resident set rises by while `fn()` runs, from a collected, trimmed heap
    and a reset high-water mark."""
    gc.collect()
    trim()
    reset_peak()
    before = status("VmHWM")
    fn()
    return status("VmHWM") - before
