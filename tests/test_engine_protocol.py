"""The engine's protocol is true (engine/__init__.py's `Engine`): every engine px.prepare
builds has each attribute and method the rest of phalanx uses, under every strategy and the
options that add parts (staleness, PowerSGD, offload, DiLoCo), so no caller probes with
getattr."""

from __future__ import annotations

import torch
import torch.nn as nn

import phalanx as px
from phalanx.engine import Engine
from phalanx.testing import run_ranks

CASES = [dict(strategy=s) for s in ("ddp", "zero1", "zero2", "zero3")] + [
    dict(strategy="ddp", staleness=1),
    dict(strategy="zero2", offload="optimizer"), dict(strategy="zero3", offload="params")]


def _protocol_names() -> set[str]:
    names = set(Engine.__annotations__)
    names |= {n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_")}
    return names


def _missing(cases) -> list:
    px.init()
    missing = []
    for options in cases + [dict(strategy=px.DiLoCo(sync_every=2)),
                            dict(strategy="ddp", compression=px.PowerSGD(rank=1))]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = px.prepare(model, opt, **options)
        engine = model._engine
        missing += [(repr(options), n) for n in sorted(_protocol_names())
                    if not hasattr(engine, n)]
    return missing


def test_every_engine_has_every_name_of_the_protocol():
    for missing in run_ranks(_missing, 2, args=(CASES,), timeout=180):
        assert missing == [], missing
