"""The replica check (`check_replicas_every`): a rank whose parameters drifted from the others'
is named, identical replicas pass, and the option takes only a number of optimizer steps.
"""

import pytest
import torch
import torch.nn.functional as F
from small_mlp import ROWS, STRATEGIES, batch, mlp, rank_rows

import phalanx as px
from phalanx.testing import run_ranks


# -- replicas that drift apart (issue "Survive failures": the checksum check) ----------------
def _drift(strategy, precision, edit_rank):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision,
                            check_replicas_every=2)
    for step in range(6):
        if step == 3 and px.rank() == edit_rank:
            with torch.no_grad():  # an edit made on one rank only
                px.unwrap(model)[2].weight.add_(1e-3)
        x, y = rank_rows(*batch(step, ROWS * px.world_size()))
        F.mse_loss(model(x), y).backward()
        try:
            opt.step()
        except px.ReplicasDiffer as exc:
            return step, str(exc)
        opt.zero_grad()
    return None


@pytest.mark.parametrize("strategy,precision", [("ddp", "fp32"), ("ddp", "bf16")])
def test_a_rank_whose_parameters_drifted_is_named(strategy, precision):
    # (under zero1/zero2 the step publishes every owner's slice to every rank, so an edit made
    # on one rank does not survive the next step: the replicas cannot drift that way)
    results = run_ranks(_drift, 3, args=(strategy, precision, 1))
    for step, message in results:
        assert step == 3  # the check of optimizer step 4 (every 2), on every rank
        assert "the replicas differ at optimizer step 4: rank(s) 1 hold other parameters" \
            in message
        assert "'2.weight'" in message


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_identical_replicas_pass_the_check(strategy):
    assert run_ranks(_drift, 2, args=(strategy, "fp32", -1)) == [None, None]


@pytest.mark.one_process
@pytest.mark.parametrize("every", [0, -2, 1.5, True, "10"])
def test_check_replicas_every_must_be_a_step_count(every):
    model = mlp()
    with pytest.raises(ValueError, match=r"check_replicas_every=.*a number of optimizer steps"):
        px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   check_replicas_every=every)
