"""torch's distributed checkpoint functions on a prepared model and optimizer, as FSDP2 scripts
call them: `get_model_state_dict`, `get_optimizer_state_dict` (or `get_state_dict`) with
`StateDictOptions`, `dcp.save`; then a fresh model and optimizer, prepared, their state dicts as
the templates `dcp.load` fills, `set_model_state_dict` and `set_optimizer_state_dict` (or
`set_state_dict`), and training on. Under ddp, zero1, zero2 and zero3 on 2 ranks the resumed run
ends where one process trained without a break ends, in float64.

The defects: `get_optimizer_state_dict` raised `KeyError: 0` under zero1/zero2/zero3 (the
optimizer's param groups held the engine's master pieces, which it maps to the model's
parameters by identity), and `full_state_dict=True` loads failed under every strategy on keys
prefixed with `module.` (engine/optim.py, model/prepared.py).
"""

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from parity import one_thread
from small_mlp import ROWS, batch, mlp, rank_rows, rel_err
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import phalanx as px
from phalanx.testing import run_ranks

WORLD, STEPS, BREAK = 2, 6, 3
STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
# "dcp": each function with its default options, dcp.save, and dcp.load into the fresh run's
#     state dicts (sharded, as FSDP2 saves with DCP);
# "combined": get_state_dict / set_state_dict with full_state_dict=True, dcp.save and dcp.load;
# "full": pytorch/examples' FSDP2 checkpoint.py: full_state_dict=True, cpu_offload=True (rank 0
#     alone holds the values), torch.save on rank 0, torch.load on every rank, loaded back with
#     full_state_dict=True, broadcast_from_rank0=True
STYLES = ["dcp", "combined", "full"]


def _build(seed):
    model = mlp(seed=seed, dtype=torch.float64)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _train(model, opt, steps, on_ranks=True):
    """Adam on the global batch of each step: this rank's rows of it, or all of it."""
    for step in steps:
        x, y = batch(step, ROWS * WORLD, dtype=torch.float64)
        if on_ranks:
            x, y = rank_rows(x, y)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _save(style, model, opt, path):
    if style == "dcp":
        dcp.save({"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    elif style == "combined":
        model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(
            full_state_dict=True))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    else:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(model, options=full)
        optim_sd = get_optimizer_state_dict(model, opt, options=full)
        if px.rank() == 0:
            torch.save({"model": model_sd, "optim": optim_sd}, path)
        px.barrier()


def _load(style, model, opt, path):
    if style == "dcp":
        state = {"model": get_model_state_dict(model),  # the templates dcp.load fills
                 "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    elif style == "combined":
        full = StateDictOptions(full_state_dict=True)
        model_sd, optim_sd = get_state_dict(model, opt, options=full)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=full)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state["model"], options=full)
        set_optimizer_state_dict(model, opt, state["optim"], options=full)


def _resumes(root):
    px.init()
    out = {}
    for strategy in STRATEGIES:
        for style in STYLES:
            path = f"{root}/{strategy}-{style}"
            model, opt = px.prepare(*_build(seed=0), strategy=strategy)
            _train(model, opt, range(BREAK))
            _save(style, model, opt, path)
            # a fresh run, from other weights: only what it loads makes it the same run
            model, opt = px.prepare(*_build(seed=1), strategy=strategy)
            _load(style, model, opt, path)
            _train(model, opt, range(BREAK, STEPS))
            out[strategy, style] = [p.detach().clone() for p in model.state_dict().values()]
    px.shutdown()
    return out


def test_dcp_state_dict_functions_resume_a_prepared_run(tmp_path):
    with one_thread():  # one process, the global batch, no break
        model, opt = _build(seed=0)
        _train(model, opt, range(STEPS), on_ranks=False)
        want = [p.detach().clone() for p in model.state_dict().values()]
    for rank, out in enumerate(run_ranks(_resumes, WORLD, args=(str(tmp_path),), timeout=120)):
        assert len(out) == len(STRATEGIES) * len(STYLES)
        for (strategy, style), params in out.items():
            for i, (a, b) in enumerate(zip(params, want)):
                assert rel_err(a, b) <= 1e-12, f"{strategy}, {style}, rank {rank}: tensor {i}"


def _flattened(strategy):
    """A flattened optimizer state dict given back to a fresh optimizer: what each rank meets."""
    one_thread()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model, opt = px.prepare(*_build(0), strategy=strategy)
    _train(model, opt, range(2))
    saved = get_optimizer_state_dict(px.unwrap(model), opt, options=options)
    fresh, fresh_opt = px.prepare(*_build(0), strategy=strategy)
    try:
        set_optimizer_state_dict(px.unwrap(fresh), fresh_opt, saved, options=options)
    except ValueError as exc:
        return str(exc)
    again = get_optimizer_state_dict(px.unwrap(fresh), fresh_opt, options=options)
    return max(rel_err(again[k], v) for k, v in saved.items() if isinstance(v, torch.Tensor))


def test_a_flattened_optimizer_state_is_loaded_or_refused_never_dropped():
    """torch's set_optimizer_state_dict rebuilds a flattened state dict's entries from the
    names in optimizer.state[param], which phalanx keys by the master pieces when it keeps them
    (zero1/2/3): every entry came empty and nothing was loaded, silently. Under ddp the state
    round-trips; under zero2 the load is refused on every rank, naming the options to use."""
    for result in run_ranks(_flattened, WORLD, args=("ddp",), timeout=120):
        assert result == 0.0, result
    for result in run_ranks(_flattened, WORLD, args=("zero2",), timeout=120):
        assert isinstance(result, str) and "flatten_optimizer_state_dict=True" in result, result
