"""Checkpoints walk a model's parts (engine/part.py) and name none of them.

- A toy feature that checkpoint/ has never heard of (`RunningSum` below: each trained
  parameter's values summed after every step, and the count of steps) keeps its state through
  px.save and px.load at another world size, in float64, against one process that sums the
  same: its tensors stored under its own name with their parameters' shapes, its count in the
  small state. It took no line of phalanx's source; outside its own code, the test adds it to
  `engine.parts()` in two lines (an engine has no method to add a part yet) and watches the
  steps through the engine's protocol. A model without it loads the checkpoint without a word.
- A kind of part the loading model lacks is shown what the checkpoint holds of it: a
  staleness=1 checkpoint loaded without staleness drops the gradient on its way, and rank 0
  warns once, at the line that called px.load.
- The parts phalanx has (PowerSGD's compressor, staleness=1's delayed gradients, DiLoCo's
  outer step) are parts under their checkpoint names, none allowed under continue mode, and a
  prepared model of every kind has every field of its written protocol
  (model/prepared_protocol.py).
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from checkpoint_runs import K, make_model, make_optimizer, train_steps

import phalanx as px
from phalanx.engine.part import Part, Range, Saved
from phalanx.model.prepared_protocol import Prepared
from phalanx.testing import engine_of, run_ranks

RTOL = 1e-12  # float64: the world sizes sum the gradients in other orders (round-off)


class RunningSum(Part):
    """The toy feature: after every optimizer step, each trained parameter's values added to a
    sum of its own, and the steps counted."""

    name = "running_sum"
    small_at = ("running_sum",)

    def __init__(self, params):
        self.params = list(params)
        self.sums = [torch.zeros_like(p) for p in self.params]
        self.steps = 0

    def after_step(self) -> None:
        self.steps += 1
        with torch.no_grad():
            for s, p in zip(self.sums, self.params):
                s.add_(p)

    def state(self, saving) -> Saved:
        out = []
        for p, s in zip(self.params, self.sums):
            name = saving.names.get(id(p))
            if name is not None and saving.writes(name):
                out.append(Range(name, 0, p.numel(), s.reshape(-1), like=name))
        return Saved(out, {"steps": self.steps})

    def load(self, loading) -> None:
        if loading.small is None:  # saved without it: a fresh start
            return
        self.steps = loading.small["steps"]
        saved = set(loading.keys())
        for p, s in zip(self.params, self.sums):
            name = loading.names.get(id(p))
            if name in saved:
                loading.read_into(name, 0, p.numel(), s)

    def by_name(self, model) -> dict:
        names = {id(p): n for n, p in px.unwrap(model).named_parameters()}
        return {names[id(p)]: s.clone() for p, s in zip(self.params, self.sums)}


def _with_running_sum(model, opt) -> RunningSum:
    engine = engine_of(model)
    toy = RunningSum(engine.params)
    parts = engine.parts
    engine.parts = lambda: [*parts(), toy]  # the line an engine method would replace
    engine.watch_steps(opt, toy.after_step)
    return toy


def _prepared(seed):
    model = make_model(seed)
    opt = make_optimizer(model)
    return px.prepare(model, opt, strategy="ddp")


def _first_half(path):
    model, opt = _prepared(0)
    toy = _with_running_sum(model, opt)
    train_steps(model, opt, K, 0, px.world_size(), px.rank())
    px.save(path, model=model, optimizer=opt, step=K)
    return toy.steps


def _second_half(path):
    plain, plain_opt = _prepared(5)  # without the toy: its state is left out, silently
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        px.load(path, model=plain, optimizer=plain_opt)
    model, opt = _prepared(99 + px.rank())
    toy = _with_running_sum(model, opt)
    assert px.load(path, model=model, optimizer=opt) == {"step": K}
    loaded = toy.steps
    train_steps(model, opt, K, K, px.world_size(), px.rank())
    return [str(w.message) for w in caught], loaded, toy.steps, toy.by_name(model)


def _reference():
    model = make_model(0)
    opt = make_optimizer(model)
    toy = RunningSum(p for p in model.parameters() if p.requires_grad)
    for step in range(2 * K):
        train_steps(model, opt, 1, step, 1, 0)
        toy.after_step()
    return toy.by_name(model)


def test_a_feature_checkpoints_never_heard_of_resumes_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    assert run_ranks(_first_half, 2, args=(path,), timeout=120) == [K, K]
    with open(os.path.join(path, "manifest.json")) as f:
        tensors = json.load(f)["tensors"]
    small = torch.load(os.path.join(path, "state.pt"), weights_only=False)
    assert small["running_sum"] == {"steps": K}
    want = _reference()
    for name in want:  # under its own name, with its parameter's shape
        assert tensors[f"running_sum/{name}"]["shape"] == tensors[f"model/{name}"]["shape"]
    for warned, loaded, steps, sums in run_ranks(_second_half, 3, args=(path,), timeout=120):
        assert warned == [] and (loaded, steps) == (K, 2 * K)
        assert sums.keys() == want.keys()
        for name, ref in want.items():
            err = ((sums[name] - ref).abs().max() / ref.abs().max()).item()
            assert err <= RTOL, (name, err)


def _stale_then_without(path, staleness):
    model = make_model(0)
    opt = make_optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2" if staleness else "ddp",
                            staleness=staleness)
    if staleness:
        train_steps(model, opt, K, 0, px.world_size(), px.rank())
        px.save(path, model=model, optimizer=opt)
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        px.load(path, model=model, optimizer=opt)
    return [(str(w.message), os.path.basename(w.filename)) for w in caught]


def test_a_kind_of_part_the_model_lacks_says_what_it_drops(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_stale_then_without, 2, args=(path, 1), timeout=120)
    warned = run_ranks(_stale_then_without, 2, args=(path, 0), timeout=120)
    assert warned[1] == []
    assert warned[0] == [("the checkpoint holds an averaged gradient still to be applied (saved "
                          "with staleness=1), and this model was prepared without staleness: it "
                          "is dropped", "test_part_walk.py")], warned


def _parts_and_fields():
    px.init()
    found = []
    fields = set(Prepared.__annotations__) | {
        n for n, v in vars(Prepared).items() if callable(v) and n != "__init__"
        and not n.startswith("__")}
    for options in (dict(strategy="ddp"), dict(strategy="zero3"),
                    dict(strategy="zero2", staleness=1),
                    dict(strategy="ddp", compression=px.PowerSGD(rank=1)),
                    dict(strategy=px.DiLoCo(sync_every=2))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = px.prepare(model, opt, **options)
        missing = sorted(n for n in fields if not hasattr(model, n))
        parts = model._parts()
        found.append((missing, [(type(p).__name__, Part in type(p).__mro__, p.name, p.small_at)
                                for p in parts]))
    return found


def test_phalanx_parts_keep_their_names_and_a_prepared_model_has_its_protocol():
    want = [[], [], [("DelayedGrads", True, "grad", ("delayed",))],
            [("PowerSGDReducer", True, "powersgd", ("powersgd",))],
            [("OuterSync", True, "diloco", ("stateful", "model.diloco"))]]
    for found in run_ranks(_parts_and_fields, 2, timeout=120):
        assert [missing for missing, _ in found] == [[]] * len(want), found
        assert [parts for _, parts in found] == want
