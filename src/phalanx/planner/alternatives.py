"""When no strategy fits: the same model planned again with some options changed, and what fits.

A user with a large model and a few small GPUs asks what would fit, not only whether it does.
The answers phalanx offers, in this order, are a full fine-tune in less memory, adapters in
place of a full fine-tune, a 4-bit base under the adapters, and offload:
- for a full fine-tune planned without offload, the same fine-tune with everything in bf16
  (precision="bf16-true": no fp32 master), AdamW's moments 8-bit (optimizer="adamw8bit") and
  each unit stepped as soon as its gradient is reduced (step_in_backward=True, so zero2/zero3
  hold two units' gradient shards, not all of them) and, for a transformer from a config, the
  loss computed a slice of the vocabulary at a time (sliced_loss=True: px.linear_cross_entropy,
  no fp32 logits of every token): no host memory, no change to what learns;
- LoRA of rank 8 (PEFT's default `r`) on the default targets (finetune.py), when the plan
  was of a full fine-tune;
- QLoRA: the same adapters over a base stored 4-bit (base_dtype="nf4"), when LoRA does not fit
  (or the plan was LoRA's already);
- offload="optimizer" (masters and optimizer state in host memory), and when that still does
  not fit, offload="params" (zero3's parameter shards there too), when the plan had no offload;
  and where offload does not fit either (the host's memory, most often), the same offload of a
  full fine-tune in bf16 with 8-bit moments (precision="bf16-true", optimizer="adamw8bit":
  2 + 2.03 bytes a parameter on the host where mixed precision's AdamW keeps 12).
Each is `plan_described` of the same description and setting with that change (and every
strategy the change is planned for); the result lists, for each, the strategies that fit with
their bytes per device and the host memory offload needs per node, and why the others do not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .finetune import DEFAULT_LORA_TARGETS, finetuned
from .sizes import format_bytes, format_count, format_seconds

__all__ = ["Alternative", "alternatives", "DEFAULT_LORA_RANK", "LEAN_FULL"]

DEFAULT_LORA_RANK = 8
# A full fine-tune in less memory: bf16 everywhere, 8-bit moments, the step in backward.
LEAN_FULL = {"precision": "bf16-true", "optimizer": "adamw8bit", "step_in_backward": True}


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
    out, offload, work = [], setting.training.offload, setting.workload
    full = work.lora_rank is None and work.trainable is None
    given = {"precision": setting.training.precision.name, "optimizer": work.optimizer,
             "step_in_backward": setting.training.step_in_backward,
             "sliced_loss": work.sliced_loss}
    # the moments 8-bit where they are Adam's (another optimizer is the user's choice); the
    # sliced loss where the plan knows the vocabulary (a config's transformer)
    wanted = {**LEAN_FULL, **({"sliced_loss": True} if desc.transformer is not None else {})}
    lean = {k: v for k, v in wanted.items() if given[k] != v
            and (k != "optimizer" or work.optimizer in ("adam", "adamw"))}
    if full and offload is None and lean:
        out.append(_try(desc, setting, plan_described, **lean))
    lora = None
    if full:
        lora = _try(desc, setting, plan_described, lora_rank=DEFAULT_LORA_RANK,
                    lora_targets=DEFAULT_LORA_TARGETS)
        out.append(lora)
    if work.base_dtype is None and work.trainable is None and (lora is None or not lora.fits):
        adapters = {} if not full else {"lora_rank": DEFAULT_LORA_RANK,
                                        "lora_targets": DEFAULT_LORA_TARGETS}
        out.append(_try(desc, setting, plan_described, **adapters, base_dtype="nf4"))
    offloaded = []
    if offload is None:
        offloaded.append(_try(desc, setting, plan_described, offload="optimizer"))
    if offload != "params" and not (offloaded and offloaded[-1].fits):
        offloaded.append(_try(desc, setting, plan_described, offload="params"))
    # where offload alone does not fit (host memory, most often), the same in bf16 with 8-bit
    # moments: less to hold on the host
    host_lean = {k: v for k, v in lean.items() if k != "step_in_backward"}
    if full and host_lean and not any(a.fits for a in offloaded):
        for level in ("optimizer", "params")[1 if offload == "params" else 0:]:
            offloaded.append(_try(desc, setting, plan_described, offload=level, **host_lean))
            if offloaded[-1].fits:
                break
    return [a for a in out + offloaded if a is not None]


def _try(desc, setting, plan_described, **change):
    try:
        changed = setting.changed(**change)
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
    if "offload" not in change and "lora_rank" not in change and "base_dtype" not in change:
        return ("a full fine-tune in less memory ("
                + ", ".join(f"{k}={v!r}" for k, v in change.items()) + ")")
    if "lora_rank" in change or "base_dtype" in change:
        rank = change.get("lora_rank", work.lora_rank)
        targets = change.get("lora_targets", work.targets)
        what = (f"LoRA rank {rank} on {', '.join(targets)}" if rank is not None
                else "the frozen base")
        if "base_dtype" in change:
            what = ("QLoRA: " if rank is not None else "") + what + \
                f" over a 4-bit base (base_dtype={change['base_dtype']!r})"
        if described is not None:
            share = described.trainable_params / described.params
            what += (f" ({format_count(described.trainable_params)} trainable parameters, "
                     f"{share:.2%})")
        return what
    leaner = {k: v for k, v in change.items() if k != "offload"}
    return (("a full fine-tune with " if full else "with ")
            + ("the optimizer offloaded" if change["offload"] == "optimizer"
               else "the optimizer and zero3's parameters offloaded")
            + f" (offload={change['offload']!r}"
            + "".join(f", {k}={v!r}" for k, v in leaner.items()) + ")")


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
