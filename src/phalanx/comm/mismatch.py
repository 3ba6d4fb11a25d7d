"""Checked collectives (PHALANX_CHECK_COLLECTIVES=1): what the ranks were about to issue, named.

[Note: checking collectives]
With PHALANX_CHECK_COLLECTIVES=1, before each collective the ranks exchange what they are about
to issue (kind, size, tag) and raise `CollectiveMismatch` on every rank when they differ
(`Comm._check_same` in collectives.py does the exchange). A skipped, extra or reordered
collective otherwise hangs (then faults/hangs.py names it) or, when sizes differ, aborts gloo
natively with no word of which collective. The exchange makes every collective wait for every
rank, so it is a debugging mode (as TORCH_DISTRIBUTED_DEBUG=DETAIL is for torch's), off by
default.
"""

from __future__ import annotations

from collections import defaultdict

from ..world import environment

__all__ = ["CollectiveMismatch", "CHECK_COLLECTIVES", "KIND_CODES", "mismatch"]


def _checking() -> bool:
    """PHALANX_CHECK_COLLECTIVES, read once at import; a value it does not take is False here
    (px.init names it, with the fix, before anything runs)."""
    try:
        return bool(environment.value("PHALANX_CHECK_COLLECTIVES"))
    except ValueError:
        return False


CHECK_COLLECTIVES = _checking()
KIND_CODES = {kind: i for i, kind in enumerate(
    ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_gather_object",
     "gather_object", "barrier", "all_to_all"], start=1)}


class CollectiveMismatch(RuntimeError):
    """The ranks are about to issue different collectives (PHALANX_CHECK_COLLECTIVES=1)."""


def mismatch(group_seq: int, parts: list) -> CollectiveMismatch:
    """The error for collective `group_seq`, from every rank's (kind, tag, bytes, step)."""
    by_what: dict = defaultdict(list)
    for r, (kind, tag, nbytes, step) in enumerate(parts):
        by_what[(kind, tag, nbytes)].append((r, step))
    described = "; ".join(
        f"rank{'s' if len(who) > 1 else ''} {', '.join(str(r) for r, _ in who)} "
        f"{'issue' if len(who) > 1 else 'issues'} {kind} ({tag}, {nbytes} bytes) at step "
        f"{who[0][1]}"
        for (kind, tag, nbytes), who in by_what.items())
    return CollectiveMismatch(
        f"the ranks disagree on collective #{group_seq}: {described}. Every rank must issue the "
        "same collectives in the same order: look for a collective under a rank-dependent "
        "condition, or ranks that run different numbers of steps or batches (px.data_loader "
        "gives every rank the same number)")
