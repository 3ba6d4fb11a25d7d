"""DCP checkpoints (torch.distributed.checkpoint) between FSDP2 and phalanx, both ways, in float64.

FSDP2 (`fully_shard` on each Linear and the model: it runs on the CPU with gloo in torch 2.13)
trains 3 steps at 2 ranks and saves with `dcp.save(get_state_dict(...))`, as FSDP2's example
does, and in torchtitan's layout; phalanx zero3 at 3 ranks resumes from it through DCP's API
(the state dicts, `dcp.load`, `set_state_dict`) and through `px.load` (both layouts), and
trains 3 more steps on the same global batches (12 rows, split 6 + 6 or 4 + 4 + 4) as FSDP2
resumed from the same checkpoint does. The reverse: zero3 at 3 ranks saves through DCP's API
and with `px.save(format="dcp")`, FSDP2 at 2 ranks resumes from each, and ends where zero3
going on without a break ends; ddp at 2 ranks `px.load`s the latter. Every run is compared with
one process that trains the 6 steps without a break too (a run that loaded nothing starts from
other weights, and one that lost the optimizer's state or step count takes other steps: either
misses by far more than 1e-12). Then damaged and foreign DCP directories, under ddp and zero3:
refused by `px.load` on every rank with a CheckpointError, the model, optimizer and RNG left as
they were; and what `px.save(format="dcp")` refuses.
"""

import itertools
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from parity import one_thread
from small_mlp import batch, mlp, rel_err
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

import phalanx as px
from phalanx.testing import run_ranks

GLOBAL_ROWS, BREAK, STEPS = 12, 3, 6
TOL = 1e-12


def _build(kind, seed=0, hidden=16):
    """The small MLP in float64 under FSDP2 (`fully_shard` on each Linear, then the model) or
    prepared by phalanx; AdamW, so the optimizer's state and step count are under test."""
    if hidden == 16:
        model = mlp(seed=seed, dtype=torch.float64)
    else:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(),
                                    torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                                    torch.nn.Linear(hidden, 3)).double()
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (px.world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return px.prepare(model, optimizer, strategy=kind)


def _train(model, optimizer, steps, world=None):
    """The global batch of each step, this rank's rows of it (all of them in one process)."""
    world = px.world_size() if world is None else world
    n = GLOBAL_ROWS // world
    lo = n * (px.rank() if world > 1 else 0)
    for step in steps:
        x, y = batch(step, GLOBAL_ROWS, dtype=torch.float64)
        F.mse_loss(model(x[lo:lo + n]), y[lo:lo + n]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(model):
    """The whole model's values, on every rank (a collective under FSDP2)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _api_save(model, optimizer, path):
    """As FSDP2's example saves with DCP (`--dcp-api`)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _api_load(model, optimizer, path, keys=("model", "optim")):
    """As FSDP2's example loads: the state dicts as the templates dcp.load fills, from one
    `get_state_dict(model, optimizer)` of a new optimizer (which steps it once at lr 0 to make
    its state: under zero3 a rank that had taken that step refused a peer still reading its
    shards for the model's state dict, in 6 of 10 runs at 3 ranks; such a step is no new
    version of the masters now, engine/stepping.py)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {keys[0]: model_sd, keys[1]: optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _titan_save(model, optimizer, path):
    """torchtitan's layout: the model's names at the top level, the optimizer flattened under
    "optimizer", and its train state beside them."""
    optim_sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
        flatten_optimizer_state_dict=True))
    dcp.save({**get_model_state_dict(model), "optimizer": optim_sd,
              "train_state": {"step": BREAK}}, checkpoint_id=path)


# -- the runs -------------------------------------------------------------------------------------
def _fsdp2_saves(root):
    px.init()
    model, optimizer = _build("fsdp2", seed=0)
    _train(model, optimizer, range(BREAK))
    _api_save(model, optimizer, f"{root}/fsdp2")
    _titan_save(model, optimizer, f"{root}/titan")
    px.shutdown()


def _zero3_resumes_and_saves(root):
    """At 3 ranks: resume from FSDP2's checkpoints (DCP's API, px.load), then a run of its own
    that saves both ways at the break and goes on."""
    px.init()
    out = {"latest_checkpoint": px.latest_checkpoint(root)}  # phalanx checkpoints only
    model, optimizer = _build("zero3", seed=1)
    _api_load(model, optimizer, f"{root}/fsdp2")
    _train(model, optimizer, range(BREAK, STEPS))
    out["dcp api"] = _full(model)

    for name in ("fsdp2", "titan"):
        model, optimizer = _build("zero3", seed=1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        scheduler.step()
        loader = px.data_loader(torch.utils.data.TensorDataset(torch.arange(24.0)),
                                batch_size=2, shuffle=True)
        next(iter(loader))  # a position within the epoch
        before = (scheduler.state_dict(), loader.sampler.state_dict())
        rng_before = torch.get_rng_state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values = px.load(f"{root}/{name}", model=model, optimizer=optimizer,
                             scheduler=scheduler, sampler=loader.sampler)
        out[f"px.load {name}: returned"] = values
        out[f"px.load {name}: warnings"] = [str(w.message) for w in caught]
        out[f"px.load {name}: stateful kept"] = \
            (scheduler.state_dict(), loader.sampler.state_dict()) == before
        out[f"px.load {name}: rng kept"] = torch.equal(torch.get_rng_state(), rng_before)
        _train(model, optimizer, range(BREAK, STEPS))
        out[f"px.load {name}"] = _full(model)

    model, optimizer = _build("zero3", seed=0)
    _train(model, optimizer, range(BREAK))
    _api_save(model, optimizer, f"{root}/zero3")
    out["px.save returned"] = px.save(f"{root}/zero3-px", model=model, optimizer=optimizer,
                                      format="dcp")
    _train(model, optimizer, range(BREAK, STEPS))
    out["going on"] = _full(model)
    px.shutdown()
    return out


def _fsdp2_resumes(root):
    """At 2 ranks: FSDP2 from its own checkpoint and from zero3's two; phalanx ddp with
    px.load from px.save's."""
    px.init()
    out = {}
    for name, path, keys in [("fsdp2", "fsdp2", ("model", "optim")),
                             ("from zero3", "zero3", ("model", "optim")),
                             ("from px.save", "zero3-px", ("model", "optimizer"))]:
        model, optimizer = _build("fsdp2", seed=1)
        _api_load(model, optimizer, f"{root}/{path}", keys)
        _train(model, optimizer, range(BREAK, STEPS))
        out[name] = _full(model)
    model, optimizer = _build("ddp", seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what it lacks: checked at 3 ranks above
        px.load(f"{root}/zero3-px", model=model, optimizer=optimizer)
    _train(model, optimizer, range(BREAK, STEPS))
    out["ddp px.load"] = _full(model)
    px.shutdown()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    run_ranks(_fsdp2_saves, 2, args=(root,), timeout=120)
    zero3 = run_ranks(_zero3_resumes_and_saves, 3, args=(root,), timeout=180)
    fsdp2 = run_ranks(_fsdp2_resumes, 2, args=(root,), timeout=120)
    with one_thread():  # one process, the global batch, no break
        model = mlp(seed=0, dtype=torch.float64)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        _train(model, optimizer, range(STEPS), world=1)
    return {"root": root, "zero3": zero3, "fsdp2": fsdp2,
            "one process": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _assert_same(got, want, what):
    assert sorted(got) == sorted(want), what
    for k in want:
        assert rel_err(got[k], want[k]) <= TOL, f"{what}: {k} {rel_err(got[k], want[k]):.1e}"


def test_fsdp2_checkpoint_resumes_in_zero3_at_another_world_size(runs):
    fsdp2 = runs["fsdp2"][0]["fsdp2"]
    _assert_same(fsdp2, runs["one process"], "FSDP2 resumed against one process")
    for rank, out in enumerate(runs["zero3"]):
        _assert_same(out["dcp api"], fsdp2, f"zero3 (DCP's API), rank {rank}")


def test_zero3_checkpoint_resumes_in_fsdp2(runs):
    going_on = runs["zero3"][0]["going on"]
    _assert_same(going_on, runs["one process"], "zero3 going on against one process")
    for rank, out in enumerate(runs["fsdp2"]):
        _assert_same(out["from zero3"], going_on, f"FSDP2 from zero3's DCP save, rank {rank}")


def test_px_load_and_px_save_of_dcp_checkpoints(runs):
    fsdp2, going_on = runs["fsdp2"][0]["fsdp2"], runs["zero3"][0]["going on"]
    for rank, out in enumerate(runs["zero3"]):
        assert out["px.save returned"] == f"{runs['root']}/zero3-px"
        assert out["latest_checkpoint"] is None, out["latest_checkpoint"]
        for name in ("fsdp2", "titan"):  # FSDP2's example's layout, and torchtitan's
            _assert_same(out[f"px.load {name}"], fsdp2, f"zero3 px.load {name}, rank {rank}")
            assert out[f"px.load {name}: returned"] == {}
            assert out[f"px.load {name}: stateful kept"], (name, rank)
            assert out[f"px.load {name}: rng kept"], (name, rank)
            said = [w for w in out[f"px.load {name}: warnings"] if "DCP checkpoint" in w]
            if rank == 0:  # once, on rank 0, naming what was not restored
                assert len(said) == 1, said
                assert "RNG states" in said[0] and "sampler position" in said[0], said
                assert "scheduler=, sampler= left as they are" in said[0], said
                if name == "titan":
                    assert "also holds train_state" in said[0], said
            else:
                assert said == [], (rank, said)
    for rank, out in enumerate(runs["fsdp2"]):
        _assert_same(out["from px.save"], going_on, f"FSDP2 from px.save(format='dcp'), {rank}")
        _assert_same(out["ddp px.load"], runs["one process"], f"ddp px.load, rank {rank}")
    assert sorted(os.listdir(runs["root"])) == ["fsdp2", "titan", "zero3", "zero3-px"]


# -- refusals -------------------------------------------------------------------------------------
def _damaged(root, source):
    """Copies of `source` (FSDP2's checkpoint), each damaged or made foreign in one way."""
    cases = {}

    def copy(name):
        where = f"{root}/{name}"
        shutil.copytree(source, where)
        return where

    os.remove(f"{copy('missing-shard')}/__1_0.distcp")
    cases["missing-shard"] = "__1_0.distcp is missing"
    where = copy("truncated-shard")
    with open(f"{where}/__0_0.distcp", "r+b") as f:
        f.truncate(os.path.getsize(f"{where}/__0_0.distcp") // 2)
    cases["truncated-shard"] = "(truncated)"
    # the same size, its bytes overwritten: only a read finds it, after the other file's values
    # were read (DCP reads file by file)
    where = copy("corrupted-shard")
    size = os.path.getsize(f"{where}/__1_0.distcp")
    with open(f"{where}/__1_0.distcp", "r+b") as f:
        f.write(b"\x00" * size)
    cases["corrupted-shard"] = "reading the DCP checkpoint"
    where = copy("other-model-metadata")
    shutil.copy(f"{root}/other-model/.metadata", f"{where}/.metadata")
    cases["other-model-metadata"] = "other shapes: 0.weight (8, 6) -> (16, 6)"
    where = copy("garbage-metadata")
    with open(f"{where}/.metadata", "wb") as f:
        f.write(b"not a pickle")
    cases["garbage-metadata"] = "cannot read"
    cases["other-names"] = "holds none of this model's tensors"
    cases["model-only"] = "holds no optimizer state"
    return cases


def _refusals(root):
    px.init()
    # another model's checkpoints, saved as FSDP2's example saves, and this model's alone
    other, other_optimizer = _build("fsdp2", seed=2, hidden=8)
    _train(other, other_optimizer, range(1))
    _api_save(other, other_optimizer, f"{root}/other-model")
    dcp.save({"model": {"encoder.weight": torch.ones(4, 4, dtype=torch.float64)}},
             checkpoint_id=f"{root}/other-names")
    same, _ = _build("fsdp2", seed=3)
    dcp.save({"model": get_model_state_dict(same)}, checkpoint_id=f"{root}/model-only")
    cases = None
    if px.rank() == 0:
        cases = _damaged(root, f"{root}/fsdp2")
    cases = _shared(cases)

    out = {}
    # ddp too: there the model's state dict holds its live parameters, which a template
    # dcp.load fills in place would be (a read failing midway would leave some overwritten)
    for strategy in ("ddp", "zero3"):
        model, optimizer = _build(strategy, seed=1)
        _train(model, optimizer, range(1))  # an optimizer with state of its own, to keep
        before = (_full(model), optimizer.state_dict(), torch.get_rng_state())
        for name, says in cases.items():
            try:
                px.load(f"{root}/{name}", model=model, optimizer=optimizer)
                out[strategy, name] = "loaded"
            except px.CheckpointError as exc:
                out[strategy, name] = says in str(exc) or str(exc)
            after = (_full(model), optimizer.state_dict(), torch.get_rng_state())
            out[strategy, name, "model kept"] = all(torch.equal(after[0][k], before[0][k])
                                                    for k in before[0])
            out[strategy, name, "optimizer kept"] = _same_state(after[1], before[1])
            out[strategy, name, "rng kept"] = torch.equal(after[2], before[2])

    # px.save(format="dcp") refuses what a DCP checkpoint cannot hold, and any path in use
    listing = sorted(os.listdir(f"{root}/fsdp2"))
    for name, kwargs in [("in use", {}), ("values", {"step": 3}), ("keep_last", {"keep_last": 2}),
                         ("background", {"background": True}), ("format", {"format": "npz"})]:
        target = f"{root}/fsdp2" if name == "in use" else f"{root}/new"
        try:
            px.save(target, model=model, optimizer=optimizer, **{"format": "dcp", **kwargs})
            out["px.save", name] = "saved"
        except (px.CheckpointError, ValueError) as exc:
            out["px.save", name] = type(exc).__name__
    out["px.save refusals wrote nothing"] = (sorted(os.listdir(f"{root}/fsdp2")) == listing
                                             and not os.path.exists(f"{root}/new"))
    os.makedirs(f"{root}/empty", exist_ok=True)  # an empty directory is taken
    px.save(f"{root}/empty", model=model, optimizer=optimizer, format="dcp")
    out["px.save into an empty directory"] = os.path.isfile(f"{root}/empty/.metadata")

    # strict=False: what matches (the last layer's bias) is loaded, the rest named
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        px.load(f"{root}/other-model", model=model, strict=False)
    saved = _full(other)
    now = _full(model)
    out["strict=False loads what matches"] = (
        torch.equal(now["4.bias"], saved["4.bias"])
        and all(torch.equal(now[k], before[0][k]) for k in now if k != "4.bias"))
    out["strict=False says what it left out"] = [
        str(w.message) for w in caught if "left out" in str(w.message)]
    px.shutdown()
    return out


def _shared(value):
    """Rank 0's picklable `value` on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _same_state(a, b):
    if sorted(a["state"]) != sorted(b["state"]) or a["param_groups"] != b["param_groups"]:
        return False
    return all(torch.equal(a["state"][i][k], b["state"][i][k])
               for i in a["state"] for k in a["state"][i])


def test_damaged_or_foreign_dcp_checkpoints_are_refused_and_change_nothing(runs):
    root = runs["root"]
    for rank, out in enumerate(run_ranks(_refusals, 3, args=(root,), timeout=180)):
        for strategy, name in itertools.product(
                ("ddp", "zero3"), ("missing-shard", "truncated-shard", "corrupted-shard",
                                   "other-model-metadata", "garbage-metadata", "other-names",
                                   "model-only")):
            what = f"{strategy}, {name}, rank {rank}"
            assert out[strategy, name] is True, f"{what}: {out[strategy, name]}"
            for kept in ("model kept", "optimizer kept", "rng kept"):
                assert out[strategy, name, kept], f"{what}: not {kept}"
        for name, kind in [("in use", "CheckpointError"), ("values", "ValueError"),
                           ("keep_last", "ValueError"), ("background", "ValueError"),
                           ("format", "ValueError")]:
            assert out["px.save", name] == kind, (name, rank, out["px.save", name])
        assert out["px.save refusals wrote nothing"], rank
        assert out["px.save into an empty directory"], rank
        assert out["strict=False loads what matches"], rank
        left_out = out["strict=False says what it left out"]
        if rank == 0:
            assert len(left_out) == 1 and "other shapes: 0.weight" in left_out[0], left_out
        else:
            assert left_out == [], (rank, left_out)
