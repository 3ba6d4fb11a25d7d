"""When no strategy fits: the same model planned again with one option changed, and what fits.

A user with a large model and a few small GPUs asks what would fit, not only whether it does.
The answers phalanx offers are adapters in place of a full fine-tune, and offload:
- LoRA of rank 8 (PEFT's default `r`) on the default targets (finetune.py), when the plan
  was of a full fine-tune;
- offload="optimizer" (masters and optimizer state in host memory), and when that still does
  not fit, offload="params" (zero3's parameter shards there too), when the plan had no offload.
Each is `plan_described` of the same description and setting with that one change (and every
strategy the change is planned for); the result lists, for each, the strategies that fit with
their bytes per device and the host memory offload needs per node, and why the others do not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .finetune import DEFAULT_LORA_TARGETS, finetuned
from .sizes import format_bytes, format_count, format_seconds

__all__ = ["Alternative", "alternatives", "DEFAULT_LORA_RANK"]

DEFAULT_LORA_RANK = 8


@dataclass
class Alternative:
    """One changed option and what fits with it. Bytes are per device, host bytes per node."""

    change: dict                # the px.plan options changed, e.g. {"offload": "optimizer"}
    fits: dict                  # strategy -> total bytes, of those that fit with headroom
    too_big: dict               # strategy -> total bytes, of the others
    host_bytes_per_node: dict   # strategy -> pinned host bytes (offload)
    recommended: str | None
    trainable_params: int
    line: str                   # what `phalanx plan` prints

    def to_dict(self) -> dict:
        return asdict(self)


def alternatives(desc, setting, result, plan_described) -> list[Alternative]:
    """What fits instead of `result` (a plan where nothing does); `desc` is the model as
    described, before the fine-tuning options."""
    out, offload = [], setting.training.offload
    if setting.workload.lora_rank is None and setting.workload.trainable is None:
        out.append(_try(desc, setting, plan_described, lora_rank=DEFAULT_LORA_RANK,
                        lora_targets=DEFAULT_LORA_TARGETS))
    if offload is None:
        out.append(_try(desc, setting, plan_described, offload="optimizer"))
    if offload != "params" and not (out and out[-1].fits and
                                            out[-1].change.get("offload") == "optimizer"):
        out.append(_try(desc, setting, plan_described, offload="params"))
    return [a for a in out if a is not None]


def _try(desc, setting, plan_described, **change):
    changed = setting.changed(**change)
    try:
        described = finetuned(desc, changed.workload.lora_rank, changed.workload.targets,
                              changed.workload.trainable)
    except ValueError as exc:  # e.g. no projection of that name in the model
        return Alternative(change, {}, {}, {}, None, desc.trainable_params,
                           f"{_what(change, setting, None)}: {exc}")
    r = plan_described(described, changed)
    fits = {n: p.total_bytes for n, p in r.strategies.items() if p.fits_with_headroom}
    too_big = {n: p.total_bytes for n, p in r.strategies.items() if n not in fits}
    host = {n: p.host_bytes_per_node for n, p in r.strategies.items() if p.host_bytes_per_node}
    return Alternative(change, fits, too_big, host, r.recommended, described.trainable_params,
                       _line(change, setting, described, r, fits, host))


def _what(change, setting, described) -> str:
    work = setting.workload
    full = work.lora_rank is None and work.trainable is None and "lora_rank" not in change
    if "lora_rank" in change:
        what = f"LoRA rank {change['lora_rank']} on {', '.join(change['lora_targets'])}"
        if described is not None:
            share = described.trainable_params / described.params
            what += (f" ({format_count(described.trainable_params)} trainable parameters, "
                     f"{share:.2%})")
        return what
    return (("a full fine-tune with " if full else "with ")
            + ("the optimizer offloaded" if change["offload"] == "optimizer"
               else "the optimizer and zero3's parameters offloaded")
            + f" (offload={change['offload']!r})")


def _line(change, setting, described, r, fits, host) -> str:
    u = setting.report.units
    what = _what(change, setting, described)

    def device(n):
        return format_bytes(r.strategies[n].total_bytes, u)

    if not fits:
        return f"{what}: does not fit either: {r.reason.split(': ', 1)[-1]}"
    if host:
        line = f"{what}: fits under " + ", ".join(
            f"{n} ({device(n)} per device, {format_bytes(host[n], u)} of pinned host memory "
            "per node)" for n in fits)
    else:
        line = (f"{what}: fits under " + ", ".join(f"{n} ({device(n)})" for n in fits)
                + " per device")
    others = [n for n in r.strategies if n not in fits]
    if others:
        line += "; " + ", ".join(f"{n} needs {_short(n, r.strategies[n], setting)}"
                                 for n in others)
    pick = r.recommended if r.recommended in fits else next(iter(fits))
    if len(fits) > 1 and not r.strategies[pick].activations_bytes:
        pick = min(fits, key=fits.get)
        line += (f"; activations are not included (a bare count): {pick} leaves the most "
                 "room for them")
    elif len(fits) > 1:
        line += f"; {pick} communicates least"
    p = r.strategies[pick]
    line += (f"; {pick}'s step: {format_seconds(p.step_time_s)} "
             f"({format_seconds(p.compute_time_s)} of compute"
             + (f", {format_seconds(p.host_step_s)} of host step" if p.host_step_s else "") + ")")
    return line


def _short(name, p, setting) -> str:
    """What `name` lacks: device memory, else host memory."""
    u, keep = setting.report.units, 1 - setting.report.headroom
    if p.total_bytes > keep * setting.hardware.memory:
        return f"{format_bytes(p.total_bytes, u)} per device"
    return f"{format_bytes(p.host_bytes_per_node, u)} of host memory per node"
