"""Every change of members, said once: one console line (from the new rank 0), an entry in the
next step's report (`px.step_stats`) and a row of `px.log` metrics.

    phalanx: rank 2 was killed by SIGKILL at step 37; step 37 redone by 3 ranks; training
        went on 0.84 s after the loss
    phalanx: rank 2 joined at step 40 (replacement 1): 4 ranks again; the others spent 0.61 s
    phalanx: rank 2 was killed by SIGKILL during the evaluation after step 9; batch 3 of the
        evaluation redone by 2 ranks; the evaluation went on 0.52 s after the loss

The step report gets `membership/world`, `membership/left` or `membership/joined` (how
many), `membership/step` and `membership/seconds`; `px.log` gets the same names at that step.
"""

from __future__ import annotations

import os
import sys
import time
import weakref

import torch

from ..comm import continuation
from ..observe.metrics import log
from ..world import runtime
from ..world.leaving import how_it_ended

__all__ = ["Events", "describe_departure"]


def describe_departure(why: dict) -> str:
    """'was killed by SIGKILL', 'raised RuntimeError: ...', 'finished', 'hung and was
    removed (...)' ([Note: a member that hangs] in membership.py)."""
    if "raised" in why:
        return f"raised {why['raised'].get('message', 'an exception')}"
    if why.get("done"):
        return "finished"
    if why.get("removed"):
        frozen = " (its process was frozen: stopped, as by SIGSTOP)" if why.get("frozen") else ""
        return f"hung and was removed by the launcher{frozen}"
    return how_it_ended(int(why.get("exitcode", 1)))


def _draws_differ() -> str:
    """[Note: random draws after a recovery]
    A rank draws dropout's masks (and any other randomness of its forward) from its own
    generator, for its own part of each batch. A step redone by fewer ranks splits the batch
    otherwise, and each survivor's generator has already advanced through the lost step: the
    redone step's masks, and every draw after it, are not the uninterrupted run's. Making them
    so would need masks drawn per sample (a generator keyed by the sample, as loader workers'
    augmentation is: data/seeding.py), which torch's dropout does not do. So where a prepared
    model holds a dropout layer that draws (p > 0, in training mode), the line that says a
    step was redone or skipped says this too: the run goes on with the same samples and the
    same averaged gradients' rule, but not with the same random draws."""
    drawing = sorted({type(m).__name__ for p in continuation.now().models()
                      for m in p.module.modules()
                      if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
                      and m.training})
    if not drawing:
        return ""
    return (f"; the model's {', '.join(drawing)} draws after the loss differ from the "
            "uninterrupted run's (each rank draws from its own generator for its part of "
            "a batch, and the batch is split over fewer ranks now)")


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Events:
    """Says each change (see the module docstring); kept by the StepBoundary it listens to."""

    def __init__(self, membership, steps):
        self.m = membership
        self.pending: dict = {}     # for the next step report
        self.clocks: "weakref.WeakSet" = weakref.WeakSet()
        self.history: list[dict] = []
        steps.on_resume.append(self.resumed)
        steps.events = self
        membership.on_regroup.append(self.regrouped)
        membership.on_drop.append(self.dropped)

    def watch(self, clock, engine) -> None:
        """A prepared model's step clock: its report shows each change, and it reads the new
        group's records after one."""
        self.clocks.add(clock)
        clock.continuing_engine = weakref.ref(engine)
        clock.extras.append(self.take)

    def regrouped(self, group) -> None:
        for clock in list(self.clocks):
            engine = clock.continuing_engine()
            if engine is not None:
                clock.groups = engine.groups()

    def dropped(self) -> None:
        for clock in list(self.clocks):
            clock.groups = []  # see Membership.drop_group

    def take(self) -> dict:
        out, self.pending = self.pending, {}
        return out

    def record(self, entry: dict, line: str, speaker: bool | None = None) -> None:
        """Keep `entry` for the next step report; the speaker (default: rank 0) prints `line`
        and logs it."""
        self.history.append(entry)
        self.pending = {f"membership/{k}": v for k, v in entry.items()
                        if isinstance(v, (int, float))}
        if speaker if speaker is not None else runtime.rank() == 0:
            print(line, file=sys.stderr, flush=True)
            log(dict(self.pending), step=entry["step"])

    def resumed(self, decision) -> None:
        """After a recovery, as training goes on (steps.py)."""
        seconds = time.time() - decision.lost_at
        left = sorted(r for r, why in decision.gone.items() if not why.get("done"))
        step = decision.committed  # steps are counted from 0: the first step not committed
        causes = ", ".join(f"rank {r} {describe_departure(decision.gone[r])}" for r in left)
        verb = "skipped" if decision.skip else "redone"
        since = f" from {os.path.basename(decision.checkpoint)}" if decision.checkpoint else ""
        ranks = f"{len(decision.survivors)} rank{'s' if len(decision.survivors) != 1 else ''}"
        if decision.evaluation is not None and decision.resume_after == step:  # gathers.py
            after = f"after step {step - 1}" if step else "before step 0"
            line = (f"phalanx: {causes} during the evaluation {after}; batch "
                    f"{decision.evaluation} of the evaluation redone by {ranks}{since}; the "
                    f"evaluation went on {seconds:.2f} s after the loss")
        else:
            line = (f"phalanx: {causes} at step {step}; step {step} {verb} by {ranks}{since}; "
                    f"training went on {seconds:.2f} s after the loss{_draws_differ()}")
        self.record({"world": len(decision.survivors), "left": len(left), "step": step,
                     "seconds": seconds, "skipped": int(decision.skip), "ranks": left}, line)

    def joined(self, ranks: list[int], step: int, seconds: float, lives: list[int],
               speaker: bool) -> None:
        """After replacements were admitted (joining.py); `speaker`: this rank was the
        others' rank 0 (a replacement may be rank 0 now)."""
        which = ", ".join(f"replacement {n}" for n in lives)
        line = (f"phalanx: {_ranks(ranks)} joined at step {step} ({which}): {self.m.world} "
                f"ranks; the others spent {seconds:.2f} s admitting")
        self.record({"world": self.m.world, "joined": len(ranks), "step": step,
                     "seconds": seconds, "ranks": ranks}, line, speaker)
