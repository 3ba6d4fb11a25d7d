"""zero3: every rank must gather the same roots in the same order; checked here.

[Note: every rank runs the same roots]
A gather is a collective: every rank must reach the same roots in the same order, as with
PyTorch's FSDP and DeepSpeed's ZeRO-3. A branch that depends on the rank (or on per-rank
randomness, such as layer drop) is fine inside one root: both branches' parameters are
gathered together. Across roots it would pair one rank's gather of one block with another's
of a different block, which gives wrong values when the two are the same size (a collective
mismatch or a hang otherwise). So at the end of every forward that records gradients, the
ranks exchange a signature of the sequence of roots they ran (one all-gather of 16 bytes per
rank) and compare them on the device; the host reads the answer with the step's one read at the
end of the backward that communicates (see [Note: one host read per step] in flat_engine.py),
and if any forward since the last such backward differed, every rank raises an error naming
where, before the optimizer step can apply anything. Forwards under `torch.no_grad()` are not
compared.
"""

from __future__ import annotations

import zlib

import torch

from .zero3_replay import ROOTS

__all__ = ["compare_roots", "raise_if_differed"]


def compare_roots(gatherer) -> None:
    """Exchange the signature of the roots `gatherer` (zero3.py's UnitGatherer) saw in this
    forward now, compare on the device; the host reads the answer with the step's one read."""
    seen = list(gatherer._forward_seen)
    gatherer.log.note(gatherer, ROOTS)  # see [Note: replaying a pass's gathers]
    mine = torch.tensor([len(seen), zlib.crc32(repr(seen).encode())], dtype=torch.int64,
                        device=gatherer.comm.device)
    signatures = torch.stack(gatherer.comm.all_gather_list(mine, tag="zero3:roots"))
    checks = gatherer._checks
    checks.append((seen, (signatures == signatures[0]).all()))
    if len(checks) > 64:  # forwards with gradients but no backward: keep the first
        first, _ = checks[0]
        gatherer._checks = [(first, torch.stack([c for _, c in checks[:-1]]).all()), checks[-1]]


def raise_if_differed(gatherer, checks: list, same: list) -> None:
    """After the step's read (`same`: one value per check): name where the ranks went
    different ways, on every rank (they all read the same answers)."""
    failed = next((seen for (seen, _), ok in zip(checks, same) if not ok), None)
    if failed is None:
        return
    paths = gatherer.comm.all_gather_object(
        [gatherer.roots[i].name or "the model" for i in failed], tag="zero3:roots")
    first = next((i for i in range(max(map(len, paths)))
                  if len({tuple(p[i:i + 1]) for p in paths}) > 1), 0)
    ran = ", ".join(f"rank {r} {p[first] if first < len(p) else 'nothing'!r}"
                    for r, p in enumerate(paths))
    raise RuntimeError(
        f"zero3: the ranks gathered different modules in this forward (gather {first + 1}: "
        f"{ran}). Each is gathered by a collective every rank joins in the same order, so "
        "a branch that depends on the rank must stay inside one module gathered as a whole "
        "(a repeated block; px.prepare(..., blocks=[its class]) makes one), or the choice "
        "the same on every rank; strategy='zero2' keeps whole parameters. (Found at the "
        "end of backward, before the optimizer step: nothing was applied.)")
