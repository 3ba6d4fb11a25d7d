"""zero3: every rank must gather the same roots in the same order, checked here; and a module
inside a root is used only while the root's forward runs, or the root is entered then.

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

[Note: a root whose module is not called]
A unit outside the repeated blocks is rooted at the model's child that holds it (units.py), on
the assumption that the model calls its children. A wrapper's forward may skip one: PEFT's
`PeftModel` (a LoRA model made without a task type) calls the model it wraps directly,
never its child `base_model`, whose parameters (the embedding, the final norm, the head) are
then used without their root's forward. So the first use of such a parameter while the model's
forward runs (a module registering it is called: its guard, below) enters the root there: its
units are gathered (a collective, at the same point on every rank: the ranks run the same
code) and kept, as the model's own root's are, until backward has used them (or the forward
ends, without gradients). Outside the model's forward and any backward such a call is refused.
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch

__all__ = ["RootChecks", "guard_modules", "engine_roots"]


class RootChecks:
    """[Note: every rank runs the same roots] for one gatherer (zero3.py): each forward's
    signature compared across the ranks on the device, kept until the step's one read.

    comm: the gatherer's group. roots: its roots, by index (their names, for the error)."""

    def __init__(self, comm, roots: list):
        self.comm = comm
        self.roots = roots
        self.pending: list = []  # (roots seen, same on every rank) per forward since the read

    def compare(self, seen: list[int]) -> None:
        """Exchange the signature of the roots `seen` in this forward now, compare on the
        device; the host reads the answer with the step's one read."""
        mine = torch.tensor([len(seen), zlib.crc32(repr(seen).encode())], dtype=torch.int64,
                            device=self.comm.device)
        signatures = torch.stack(self.comm.all_gather_list(mine, tag="zero3:roots"))
        checks = self.pending
        checks.append((seen, (signatures == signatures[0]).all()))
        if len(checks) > 64:  # forwards with gradients but no backward: keep the first
            first, _ = checks[0]
            self.pending = [(first, torch.stack([c for _, c in checks[:-1]]).all()), checks[-1]]

    def take(self) -> list:
        """The (roots seen, same on every rank) of the forwards since the last backward."""
        checks, self.pending = self.pending, []
        return checks

    def raise_if_differed(self, checks: list, same: list) -> None:
        """After the step's read (`same`: one value per check): name where the ranks went
        different ways, on every rank (they all read the same answers)."""
        failed = next((seen for (seen, _), ok in zip(checks, same) if not ok), None)
        if failed is None:
            return
        paths = self.comm.all_gather_object(
            [self.roots[i].name or "the model" for i in failed], tag="zero3:roots")
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


def guard_modules(modules: dict, roots: list, units: list,
                  entered: Callable[[object], bool]) -> list:
    """Hooks on every module that registers parameters of a root other than itself: called
    while that root's forward is not running, it would compute on freed storage (or on whatever
    happens to be gathered), so the root is entered there (see [Note: a root whose module is
    not called]) or the call refused (a check of a flag per call). `modules`: the model's, by
    qualified name; `roots` and `units`: the gatherer's; `entered(root)`: whether the root's
    forward runs, or it was entered now (the gatherer's). Returns the hooks' handles."""
    root_of = {id(u): r for r in roots for u in r.units}
    unit_of = {id(p): u for u in units for p in u.members}
    handles = []
    for name, sub in modules.items():
        mine = {root_of[id(unit_of[id(p)])] for p in sub._parameters.values()
                if p is not None and id(p) in unit_of}
        if any(root.name != name for root in mine):
            handles.append(sub.register_forward_pre_hook(
                _guard(name, sorted(mine, key=lambda r: r.index), entered)))
    return handles


def _guard(name: str, roots: list, entered: Callable[[object], bool]):
    def hook(_module, _args):
        for root in roots:
            if not entered(root):
                raise RuntimeError(
                    f"zero3: module {name!r} was called on its own, but its parameters are "
                    f"gathered only during the forward of {root.name or 'the model'!r} (between "
                    "uses each rank keeps 1/N of them); call the prepared model instead, or "
                    "prepare with strategy='zero2', which keeps whole parameters")
            for unit in root.units:
                unit.wait_gathered()
    return hook


def engine_roots(engine) -> dict | None:
    """What a zero3 engine gathers together, for RUN_DIR/run.json: px.prepare records it, and
    `phalanx report` plans the run with it (`ModelDesc.zero3_roots` and px.prepare's
    gathering options), since a parameter count alone does not say which units stay gathered
    from forward into backward. The roots are [name, elements] in the engine's order
    (backward's; "" is the model itself), the elements being those it gathers: every member
    of its units, the trainable parameters and the frozen ones gathered with them ([Note:
    frozen parameters in a unit] in engine/flat.py: `FlatUnit.members`). None for a strategy
    that gathers nothing."""
    gatherer = engine.gatherer
    if gatherer is None:
        return None
    return {"roots": [[root.name, sum(p.numel() for unit in root.units for p in unit.members)]
                      for root in gatherer.roots],
            "prefetch": gatherer.prefetch,
            "max_gathered_mb": None if gatherer.limit is None else gatherer.limit / 2**20,
            "reshard_after_forward": gatherer.reshard_after_forward}
