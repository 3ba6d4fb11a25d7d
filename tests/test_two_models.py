"""Two prepared models in one job (a GAN's generator and discriminator, a teacher and a
student): each counts its own steps."""

from __future__ import annotations

import torch
import torch.nn as nn

import phalanx as px
from phalanx.comm import records
from phalanx.testing import engine_of, run_ranks


def _two_models(steps=3):
    torch.manual_seed(0)
    made = []
    for strategy in ("ddp", "zero2"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        made.append(px.prepare(model, opt, strategy=strategy))
    for _ in range(steps):
        for model, opt in made:
            model(torch.randn(2, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    reports = [px.step_stats(model)["step"] for model, _ in made]
    counters = [engine_of(model).steps.value for model, _ in made]
    stamped = {rec.step for model, _ in made for rec in engine_of(model).comm.records}
    return reports, counters, records.current_step(), max(stamped)


def test_each_prepared_model_counts_its_own_steps():
    for reports, counters, current, last_stamped in run_ranks(_two_models, 2, timeout=60):
        assert reports == [2, 2]      # the index of the last step, from 0
        assert counters == [3, 3]     # not 6: the other model's steps are not counted
        assert current == 3           # what px.log writes when given no step
        assert last_stamped == 2      # the last step's collectives were issued at step 2
