"""A prepared model, its optimizer and its engine are freed when the user drops them.

A notebook or a sweep prepares many models in one process; if phalanx kept any of them alive,
each would hold its parameters, gradients and optimizer state until the process ends.
"""

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import phalanx as px
from phalanx.testing import engine_of, run_ranks


def _train_save_and_drop(where, strategy, precision):
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    for _ in range(2):
        model(torch.randn(4, 16)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    px.save(f"{where}/ckpt", model=model, optimizer=opt)
    px.save(f"{where}/background", model=model, optimizer=opt, background=True)
    px.load(f"{where}/ckpt", model=model, optimizer=opt)  # waits for the background save
    refs = {"engine": weakref.ref(engine_of(model)), "prepared model": weakref.ref(model),
            "optimizer": weakref.ref(opt), "parameter": weakref.ref(px.unwrap(model)[0].weight)}
    del model, opt
    gc.collect()
    # a sharded model's shards stay readable by the peers until the next blocking collective
    # ([Note: a model dropped while a peer reads it] in engine/remote.py)
    px.barrier()
    gc.collect()
    return sorted(name for name, ref in refs.items() if ref() is not None)


@pytest.mark.parametrize("strategy,precision", [("ddp", "fp32"), ("zero1", "bf16"),
                                                ("zero2", "fp16"), ("zero2", "fp32")])
def test_a_dropped_prepared_model_is_freed(tmp_path, strategy, precision):
    assert run_ranks(_train_save_and_drop, 2, args=(str(tmp_path), strategy, precision)) == \
        [[], []]
