"""Reading and writing quantities: byte sizes, parameter counts, bandwidths.

Units are explicit because the difference matters at this scale: 80 GB (decimal, 1e9 bytes) is
74.5 GiB (binary, 2**30 bytes). A size without a unit is refused rather than guessed. Every
parser raises `ValueError` with one line that names the bad text and shows a good one; the
command line turns that into its one-line error.
"""

from __future__ import annotations

import math
import re

__all__ = ["GB", "GiB", "parse_bytes", "parse_count", "parse_bandwidth", "format_bytes",
           "format_count", "format_seconds"]

GB = 10**9
GiB = 2**30

_BYTE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # A bare prefix is read as decimal, as disk and GPU vendors write it.
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = r"([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)"


def _number(text: str) -> float:
    return float(text.replace("_", ""))


def parse_bytes(value, what: str = "size") -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '1.5TB', '512MiB'. Ints pass through as bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is not a size: write e.g. 80GB or 80GiB")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"{what} {value!r} must be a non-negative number of bytes")
        return int(value)
    text = str(value).strip()
    m = re.fullmatch(_NUMBER + r"\s*([A-Za-z]*)", text)
    if not m:
        raise ValueError(f"cannot read {what} {text!r}: write e.g. 80GB (1e9 bytes) or "
                         f"80GiB (2^30 bytes)")
    number, unit = _number(m.group(1)), m.group(2).lower()
    if unit == "":
        raise ValueError(f"{what} {text!r} has no unit: write {text}GB (1e9 bytes) or "
                         f"{text}GiB (2^30 bytes)")
    if unit not in _BYTE_UNITS:
        raise ValueError(f"unknown unit {m.group(2)!r} in {what} {text!r}: use B, KB, MB, GB, TB "
                         f"(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")
    return int(round(number * _BYTE_UNITS[unit]))


def parse_count(value, what: str = "parameter count") -> int:
    """'8e9', '8B', '7.5b', '125M', '350k', '8_000_000_000' -> an int (B = billion)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is not a number")
    if isinstance(value, (int, float)):
        if value <= 0 or not math.isfinite(value):
            raise ValueError(f"{what} must be positive, got {value!r}")
        return int(round(value))
    text = str(value).strip()
    m = re.fullmatch(_NUMBER + r"\s*([A-Za-z]?)", text)
    if not m or m.group(2).lower() not in _COUNT_SUFFIX:
        raise ValueError(f"cannot read {what} {text!r}: write e.g. 8e9, 8B, 7.5B, 125M or 350k")
    count = _number(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()]
    if count < 1:
        raise ValueError(f"{what} must be at least 1, got {text!r}")
    return int(round(count))


def parse_bandwidth(value, presets: dict[str, float], what: str = "bandwidth") -> float:
    """A bandwidth in GB/s: a number ('450'), with a unit ('450GB/s', '400Gb/s', '400Gbps'),
    or a preset name ('nvlink4'). Bits (lower-case b) are divided by 8."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{what} must be positive, got {value!r}")
        return float(value)
    text = str(value).strip()
    if text.lower() in presets:
        return presets[text.lower()]
    m = re.fullmatch(_NUMBER + r"\s*(GB/s|GBps|Gb/s|Gbps|Gbit/s)?", text)
    if not m:
        names = ", ".join(sorted(presets))
        raise ValueError(f"unknown {what} {text!r}: give GB/s (e.g. 450 or 400Gb/s) or a preset "
                         f"({names})")
    number = _number(m.group(1))
    if number <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    unit = m.group(2) or "GB/s"
    return number / 8 if unit.startswith("Gb") else number


def format_bytes(n: float, unit: str = "GB", digits: int = 1) -> str:
    """Bytes in the given unit ('GB' = 1e9, 'GiB' = 2**30), with the unit written after."""
    scale = {"GB": GB, "GiB": GiB, "MB": 10**6, "MiB": 2**20}[unit]
    return f"{n / scale:.{digits}f} {unit}"


def format_count(n: float) -> str:
    """7_500_000_000 -> '7.50B'; 124_439_808 -> '124.4M'."""
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}" if n < 10 * scale else f"{n / scale:.1f}{suffix}"
    return str(int(n))


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"
