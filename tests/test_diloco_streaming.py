"""Streaming DiLoCo (`px.DiLoCo(fragments=, delay=, keep_local=, comm_dtype='int4')`): real
ranks on gloo, float64, against the one-process simulation of diloco_sim.py; its checkpoints
at the same and at another world size; its step report; what it refuses."""

import warnings

import pytest
import torch
from diloco_sim import FRAGMENTS, Simulation, diloco, rank_run
from test_diloco import _inner, _local_step, _model

import phalanx as px
from phalanx.engine.diloco import fragment_of
from phalanx.engine.diloco_wire import quantized_bytes
from phalanx.testing import run_ranks

TIMEOUT = 120
# (H, P, D, keep_local, comm_dtype): every option, 9 steps each (two cycles and a step past)
CONFIGS = [(4, 2, 1, 0.5, "int4"), (6, 3, 0, 0.0, None), (4, 2, 1, 0.0, "int8"),
           (4, 4, 0, 0.0, "int4"), (1, 1, 0, 0.0, "int4")]


def _assert_close(got, want, context):
    for i, (a, b) in enumerate(zip(got, want)):
        err = (a - b).abs().max().item()
        assert err <= 1e-12 * max(b.abs().max().item(), 1.0), f"{context}: param {i} off by {err}"


@pytest.mark.one_process
def test_fragments_are_runs_of_about_equal_size():
    assert fragment_of([96, 16, 48, 3], 2) == FRAGMENTS[2]
    assert fragment_of([96, 16, 48, 3], 3) == FRAGMENTS[3]
    assert fragment_of([1, 1, 1, 100], 2) == [[0, 1, 2], [3]]
    assert fragment_of([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert fragment_of([5, 5], 2) == [[0], [1]]


def test_streaming_equals_a_one_process_simulation_of_its_workers():
    """2 ranks, AdamW inner, outer Nesterov 0.7/0.9, 9 steps of each config in one job: every
    rank's weights equal the simulation's; the int4 and int8 payloads are what the report
    says (with a delay, in the step the average completes in); a step that sends nothing
    reports nothing."""
    results = run_ranks(rank_run, 2, args=(CONFIGS, 9), timeout=TIMEOUT)
    for c, (H, P, D, keep, wire) in enumerate(CONFIGS):
        sim = Simulation(2, H, P, D, keep, wire, "adamw").run(9)
        for rank in range(2):
            _assert_close(results[rank][c][0], list(map(torch.Tensor.detach, sim.weights(rank))),
                          f"{CONFIGS[c]} rank {rank}")
        same = all(torch.equal(a, b) for a, b in zip(results[0][c][0], results[1][c][0]))
        assert same == (H == 1), f"{CONFIGS[c]}: the ranks' weights differ unless all synced"
    sizes = [96, 16, 48, 3]
    for c in (3, 4):  # delay 0: each send's collective is done within its step
        H, P, _, _, wire = CONFIGS[c]
        for step, report in enumerate(results[0][c][1]):
            if (step + 1) % (H // P):
                assert report["comm_bytes"] == 0, (CONFIGS[c], step)
                continue
            k = ((step + 1) % H // (H // P) - 1) % P
            payload = quantized_bytes([sizes[i] for i in FRAGMENTS[P][k]], torch.int4, 8)
            assert report["all_gather/bytes"] == 2 * payload, (CONFIGS[c], step)
    for c in (0, 2):  # a delay: each average counts once, in the step it completes in
        H, P, _, _, wire = CONFIGS[c]
        every, dtype = H // P, {"int4": torch.int4, "int8": torch.int8}[wire]
        sends = [step for step in range(9) if (step + 1) % every == 0]  # each applied by step 8
        want = sum(2 * quantized_bytes([sizes[i] for i in FRAGMENTS[P][
            ((step + 1) % H // every - 1) % P]], dtype, 8) for step in sends)
        got = [report.get("all_gather/bytes", 0) for report in results[0][c][1]]
        assert sum(got) == want, (CONFIGS[c], got)


def _save_part(path, config, steps):
    world, rank = px.world_size(), px.rank()
    model = _model()
    opt = _inner("sgd", model)
    model, opt = px.prepare(model, opt, strategy=diloco(*config))
    for step in range(steps):
        _local_step(model, opt, step, rank, world)
    px.save(path, model=model, optimizer=opt)
    return [p.detach().clone() for p in px.unwrap(model).parameters()]


def _resume_part(path, config, first, steps):
    world, rank = px.world_size(), px.rank()
    model = _model()
    opt = _inner("sgd", model)
    model, opt = px.prepare(model, opt, strategy=diloco(*config))
    loaded = None
    if path is not None:
        px.load(path, model=model, optimizer=opt)
        loaded = [p.detach().clone() for p in px.unwrap(model).parameters()]
    for step in range(first if path is not None else 0, first + steps):
        _local_step(model, opt, step, rank, world)
    return loaded, [p.detach().clone() for p in px.unwrap(model).parameters()]


# H=6, 3 fragments (one sent every 2 steps), delay 1, keep_local 0.5, int4 with error feedback
STREAMING = (6, 3, 1, 0.5, "int4")


@pytest.mark.parametrize("saved_after", [4, 7])
def test_a_save_anywhere_resumes_exactly_at_the_same_world_size(tmp_path, saved_after):
    """Saved with a fragment's average in flight (after step 4: sent, due after step 5) and
    between two sends (after step 7); 2 ranks resume and equal the run that did not stop."""
    path = str(tmp_path / "ckpt")
    run_ranks(_save_part, 2, args=(path, STREAMING, saved_after), timeout=TIMEOUT)
    resumed = run_ranks(_resume_part, 2, args=(path, STREAMING, saved_after, 6),
                        timeout=TIMEOUT)
    straight = run_ranks(_resume_part, 2, args=(None, STREAMING, saved_after, 6),
                         timeout=TIMEOUT)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(resumed[rank][1], straight[rank][1])), rank


def test_a_checkpoint_resumes_at_another_world_size(tmp_path):
    """Saved on 2 ranks with a fragment's average in flight; on 3 ranks the load applies it,
    every rank starts from the synced weights with the mean error feedback, and 6 more steps
    equal the simulation that does the same."""
    path = str(tmp_path / "ckpt")
    run_ranks(_save_part, 2, args=(path, STREAMING, 4), timeout=TIMEOUT)
    results = run_ranks(_resume_part, 3, args=(path, STREAMING, 4, 6), timeout=TIMEOUT)
    sim = Simulation(2, *STREAMING, "sgd").run(4)
    assert sim.flight is not None
    sim.resize(3)
    for loaded, _ in results:
        _assert_close(loaded, sim.synced, "loaded on 3 ranks")
    sim.run(6)
    for rank, (_, params) in enumerate(results):
        _assert_close(params, list(map(torch.Tensor.detach, sim.weights(rank))), f"rank {rank}")


@pytest.mark.one_process
@pytest.mark.parametrize("kwargs,match", [
    ({"fragments": 0}, "fragments=0"), ({"sync_every": 10, "fragments": 3}, "e.g. sync_every=12"),
    ({"sync_every": 4, "fragments": 2, "delay": 2}, "below sync_every / fragments = 2"),
    ({"delay": -1}, "0 or more"), ({"keep_local": 1.5}, "from 0"),
    ({"comm_dtype": "int2"}, "'int4'"), ({"error_feedback": 1}, "True or False")])
def test_bad_streaming_configurations_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        px.DiLoCo(**{"sync_every": 4, **kwargs})


def _refused(path):
    """More fragments than parameters; a checkpoint with a fragment in flight loaded with
    other fragments: each message on this rank."""
    messages = []
    model = _model()
    try:
        px.prepare(model, _inner("sgd", model), strategy=px.DiLoCo(sync_every=5, fragments=5))
    except ValueError as exc:
        messages.append(str(exc))
    _save_part(path, STREAMING, 4)
    model = _model()
    opt = _inner("sgd", model)
    model, opt = px.prepare(model, opt, strategy=diloco(6, 2, 1, 0.5, "int4"))
    try:
        px.load(path, model=model, optimizer=opt)
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_what_streaming_refuses_is_refused_on_every_rank(tmp_path):
    for messages in run_ranks(_refused, 2, args=(str(tmp_path / "ckpt"),), timeout=TIMEOUT):
        assert len(messages) == 2, messages
        assert "4 trainable parameter(s)" in messages[0] and "fragments=4 or fewer" in messages[0]
        assert "the fragments= it was saved with" in messages[1]


def _load_not_diloco(path):
    """The checkpoint at `path` loaded into ddp with the optimizer, then into a plain module
    (what px.export gets): the weights ddp got, and the warnings that name DiLoCo."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _model()
        opt = _inner("sgd", model)
        model, opt = px.prepare(model, opt, strategy="ddp")
        px.load(path, model=model, optimizer=opt)
        loaded = [p.detach().clone() for p in px.unwrap(model).parameters()]
        px.load(path, model=_model())
    return loaded, [str(w.message) for w in caught if "DiLoCo" in str(w.message)]


def test_a_checkpoint_resumed_under_ddp_says_what_it_leaves_out(tmp_path):
    """Saved on 2 ranks after step 4 (a fragment's average in flight, the outer momentum of
    the fragment applied, error feedback) and resumed under ddp: every rank takes the synced
    weights (float64, against the simulation), and rank 0 warns once, naming what ddp leaves
    out and what keeps it; a plain module (evaluation, px.export) is not warned. A checkpoint
    of a DiLoCo that is ddp (sync_every=1, outer lr 1, no momentum) leaves nothing out, and
    nothing is said."""
    path = str(tmp_path / "ckpt")
    run_ranks(_save_part, 2, args=(path, STREAMING, 4), timeout=TIMEOUT)
    results = run_ranks(_load_not_diloco, 2, args=(path,), timeout=TIMEOUT)
    sim = Simulation(2, *STREAMING, "sgd").run(4)
    assert sim.flight is not None
    for rank, (loaded, _) in enumerate(results):
        _assert_close(loaded, sim.synced, f"rank {rank} under ddp")
    (warned,), rank1 = results[0][1], results[1][1]
    assert rank1 == []
    for words in ("not DiLoCo", "the weights of the last sync", "4 steps into a cycle of 6",
                  "the outer momentum", "a fragment's average in flight",
                  "each rank's error feedback", "load it into a model prepared with the "
                  "px.DiLoCo it was saved with"):
        assert words in warned, (words, warned)
    plain = str(tmp_path / "plain")
    run_ranks(_save_part, 2, args=(plain, (1, 1, 0, 0.0, None, 1.0, 0.0), 3), timeout=TIMEOUT)
    assert [said for _, said in run_ranks(_load_not_diloco, 2, args=(plain,),
                                          timeout=TIMEOUT)] == [[], []]


def _resume_warned(path, config, first, steps):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, _ = _resume_part(path, config, first, steps)
    return loaded, [str(w.message) for w in caught if "DiLoCo" in str(w.message)]


def test_a_save_at_the_end_of_a_cycle_resumed_at_another_world_size_warns(tmp_path):
    """Streaming, saved after step 6 (the end of a cycle: the count at 0) on 2 ranks and
    resumed on 3: each rank's weights held steps made since each fragment's sync (fragments 0
    and 1 applied 3 and 1 steps before, fragment 2 in flight), which the resume from the
    synced weights loses: rank 0 says so (it said nothing, the count being 0)."""
    path = str(tmp_path / "ckpt")
    run_ranks(_save_part, 2, args=(path, STREAMING, 6), timeout=TIMEOUT)
    results = run_ranks(_resume_warned, 3, args=(path, STREAMING, 6, 0), timeout=TIMEOUT)
    sim = Simulation(2, *STREAMING, "sgd").run(6)
    assert sim.phase == 0
    assert not all(torch.equal(w, s) for w, s in zip(sim.weights(0), sim.synced))
    sim.resize(3)
    for rank, (loaded, _) in enumerate(results):
        _assert_close(loaded, sim.synced, f"rank {rank}")
    (warned,) = results[0][1]
    assert "saved 0 steps into a cycle of 6 at world size 2 (streaming)" in warned, warned
    assert "the inner steps each rank made since are not in it" in warned, warned
    assert results[1][1] == results[2][1] == []
