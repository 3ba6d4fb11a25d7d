"""Loading weights through the user's module, as Accelerate's scripts do
(`accelerator.unwrap_model(model).load_state_dict(sd)`, here `px.unwrap(model).load_state_dict`),
reaches the masters exactly under every strategy and precision, as loading through the prepared
model does: under bf16 the parameters torch writes hold the values rounded to bf16, and the
fp32 masters held those rounded values (3.9e-3 from the loaded weights on an HF Llama) where
they must hold every bit. See model/prepared.py.
"""

import torch
from small_mlp import ROWS, batch, mlp

import phalanx as px
from phalanx.testing import run_ranks

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


def _weights():
    """fp32 values with every mantissa bit in use (none is a bf16 value), the same on every
    rank."""
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=g) for k, v in mlp().state_dict().items()}


def _load_everywhere():
    px.init()
    weights = _weights()
    x, _ = batch(0, ROWS)
    out = {}
    for precision in ("fp32", "bf16"):
        plain = mlp()
        plain.load_state_dict(weights)
        if precision == "bf16":
            plain, x_in = plain.to(torch.bfloat16), x.to(torch.bfloat16)
        else:
            x_in = x
        with torch.no_grad():
            want = plain(x_in).float()
        for strategy in STRATEGIES:
            for via in ("unwrapped", "prepared"):
                model = mlp()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                # several units, and parameters split between the ranks' shards
                model, opt = px.prepare(model, opt, strategy=strategy, precision=precision,
                                        bucket_mb=0.001)
                target = px.unwrap(model) if via == "unwrapped" else model
                target.load_state_dict(weights)
                px.barrier()  # every rank has loaded before one reads the others' shards
                masters = model.state_dict()  # the masters, read from the peers where sharded
                exact = all(torch.equal(masters[k], v) for k, v in weights.items())
                with torch.no_grad():
                    same_forward = torch.equal(model(x), want)
                out[precision, strategy, via] = (exact, same_forward)
    try:
        px.unwrap(model).load_state_dict(weights, assign=True)
        out["assign"] = None
    except ValueError as exc:
        out["assign"] = str(exc)
    px.shutdown()
    return out


def test_loading_through_the_unwrapped_module_reaches_the_masters_exactly():
    for rank, out in enumerate(run_ranks(_load_everywhere, 2, timeout=90)):
        assign = out.pop("assign")
        for (precision, strategy, via), (exact, same_forward) in out.items():
            where = f"{strategy} {precision} through the {via} module, rank {rank}"
            assert exact, f"{where}: the masters are not the loaded values"
            assert same_forward, f"{where}: the forward does not use the loaded values"
        assert "assign=False" in assign  # load_state_dict(assign=True) is refused by name
