"""px.save / px.load / px.latest_checkpoint / px.export on real ranks (gloo), in float64.

A run is split in two: train K steps, save, and in fresh processes (another world size,
strategy or precision) build the model from another seed, prepare, load, train K more steps.
The result is compared with one process that trained 2K steps on the same global batches.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import RanksFailed, run_ranks

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4 ranks
K = 3


class TiedLM(nn.Module):
    """Tied input and output embeddings, a frozen layer and a buffer: every kind of tensor."""

    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.inp = nn.Linear(d, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(16, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("temperature", torch.tensor(1.5))

    def forward(self, tokens):
        h = torch.tanh(self.inp(self.embed(tokens)))
        h = torch.tanh(self.frozen(h))
        return self.head(torch.tanh(self.out(h))) / self.temperature


def _model(seed):
    torch.manual_seed(seed)
    return TiedLM().double()


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=g)


def _train(model, opt, steps, first_step, world, rank):
    rows = GLOBAL_BATCH // world
    for step in range(first_step, first_step + steps):
        tokens = _batch(step)[rank * rows:(rank + 1) * rows]
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _state(model, opt):
    """Parameters and buffers by name, and the optimizer state by parameter name, as one
    process has them (float64). (zero3 keeps no whole parameter: the prepared model's
    state_dict() gathers them.)"""
    zero3 = getattr(getattr(model, "_engine", None), "reshards", False)
    source = model if zero3 else px.unwrap(model)
    params = {k: v.detach().double().clone() for k, v in source.state_dict().items()}
    names = [n for n, _ in px.unwrap(model).named_parameters()]  # the optimizer's order
    sd = px.optimizer_state_dict(opt)
    optim = {}
    for index, s in sd["state"].items():
        optim[names[int(index)]] = {k: v.double().clone() for k, v in s.items() if torch.is_tensor(v)}
    return params, optim


def _first_half(path, strategy, precision):
    torch.manual_seed(7 + px.rank())  # only the broadcast makes the ranks agree
    model = _model(0)
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    _train(model, opt, K, 0, px.world_size(), px.rank())
    px.save(path, model=model, optimizer=opt, step=K)
    return True


def _second_half(path, strategy, precision):
    model = _model(99 + px.rank())  # other values everywhere: only the load can set them
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    values = px.load(path, model=model, optimizer=opt)
    assert values == {"step": K}
    _train(model, opt, K, K, px.world_size(), px.rank())
    return _state(model, opt)


def _reference():
    model = _model(0)
    opt = _optimizer(model)
    _train(model, opt, 2 * K, 0, 1, 0)
    return _state(model, opt)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _assert_close(got, want, rtol):
    params, optim = got
    ref_params, ref_optim = want
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        assert _rel(params[name], ref_params[name]) <= rtol, name
    assert optim.keys() == ref_optim.keys()
    for name in ref_optim:
        for key in ref_optim[name]:
            assert _rel(optim[name][key], ref_optim[name][key]) <= rtol, (name, key)


LAYOUTS = [(s, n) for s in ("ddp", "zero1", "zero2", "zero3") for n in (1, 2, 3, 4)]
PAIRS = [(a, b) for a in LAYOUTS for b in LAYOUTS] if os.environ.get("PHALANX_SLOW") == "1" else [
    (("ddp", 2), ("zero2", 3)),
    (("zero2", 3), ("ddp", 2)),
    (("zero1", 4), ("zero2", 2)),
    (("zero2", 2), ("zero1", 1)),
    (("zero3", 2), ("ddp", 3)),
    (("zero1", 3), ("zero3", 2)),
]  # PHALANX_SLOW=1: every pair of 4 strategies x 1-4 ranks (256)


@pytest.mark.parametrize("saved,loaded", PAIRS)
def test_a_checkpoint_resumes_at_another_world_size_and_strategy(tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    run_ranks(_first_half, saved[1], args=(path, saved[0], "fp32"), timeout=120)
    results = run_ranks(_second_half, loaded[1], args=(path, loaded[0], "fp32"), timeout=120)
    want = _reference()
    for got in results:
        _assert_close(got, want, 1e-12)


# -- the same world size and strategy: bit for bit, RNG included -------------------------------
def _noisy_run(path, strategy, mode):
    """Train with noise drawn from each rank's own RNG; mode: 'whole' (2K steps), 'save' (K
    steps, then save), 'resume' (load, then K steps)."""
    torch.manual_seed(5 + px.rank())
    model = _model(0)
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy)
    rows = GLOBAL_BATCH // px.world_size()

    def steps(first, n):
        for step in range(first, first + n):
            tokens = _batch(step)[px.rank() * rows:(px.rank() + 1) * rows]
            noise = torch.randn(rows, 4, 11, dtype=torch.float64) * 0.1  # this rank's RNG
            logits = model(tokens[:, :-1]) + noise
            F.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()

    if mode == "resume":
        torch.manual_seed(12345)  # a different RNG state: the load must restore it
        px.load(path, model=model, optimizer=opt)
        steps(K, K)
    else:
        steps(0, 2 * K if mode == "whole" else K)
        if mode == "save":
            px.save(path, model=model, optimizer=opt)
            return None
    return _state(model, opt)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_resuming_at_the_same_world_size_is_bit_for_bit(tmp_path, strategy):
    path = str(tmp_path / "ckpt")
    whole = run_ranks(_noisy_run, 2, args=(path, strategy, "whole"))
    run_ranks(_noisy_run, 2, args=(path, strategy, "save"))
    resumed = run_ranks(_noisy_run, 2, args=(path, strategy, "resume"))
    for got, want in zip(resumed, whole):
        for name in want[0]:
            assert torch.equal(got[0][name], want[0][name]), name
        for name in want[1]:
            for key in want[1][name]:
                assert torch.equal(got[1][name][key], want[1][name][key]), (name, key)


# -- bf16 masters, export ----------------------------------------------------------------------
def _save_bf16_and_export(path, export_path):
    torch.manual_seed(0)
    model = TiedLM()  # fp32 masters, bf16 compute
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2", precision="bf16")
    _train(model, opt, K, 0, px.world_size(), px.rank())
    px.save(path, model=model, optimizer=opt)
    px.export(export_path, model)
    return True


def test_bf16_zero2_masters_load_into_a_plain_fp32_model_and_export_matches(tmp_path):
    from safetensors.torch import load_file

    path, exported = str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")
    run_ranks(_save_bf16_and_export, 2, args=(path, exported))
    weights = load_file(exported)
    assert all(t.dtype == torch.float32 for t in weights.values())
    plain = TiedLM()
    plain.load_state_dict(weights)  # every name, the tied one included
    loaded = TiedLM()
    px.load(path, model=loaded)  # a world of one, no prepare
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, weights[name]), name
    # the masters carry what bf16 cannot: they are not bf16 values widened
    trained = weights["inp.weight"]
    assert not torch.equal(trained, trained.bfloat16().float())
    # the offline export of the checkpoint is the same file's content
    offline = str(tmp_path / "offline.safetensors")
    px.checkpoint.export_checkpoint(path, offline)
    again = load_file(offline)
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[k], weights[k]) for k in weights)


# -- integrity and mismatches: an error on every rank, nothing changed ---------------------------
def _save_one(path):
    model = _model(0)
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2")
    _train(model, opt, 1, 0, px.world_size(), px.rank())
    px.save(path, model=model, optimizer=opt, step=1)
    return True


def _load_must_fail(path, words, other_model=False):
    model = nn.Linear(3, 3).double() if other_model else _model(3)
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2")
    before = {k: v.clone() for k, v in px.unwrap(model).state_dict().items()}
    try:
        px.load(path, model=model, optimizer=opt)
    except px.CheckpointError as exc:
        message = str(exc)
    else:
        raise AssertionError("px.load did not raise")
    after = px.unwrap(model).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing half-loaded
    for word in words:
        assert word in message, message
    return message


def _flip_a_byte(path):
    _flip_a_byte_of(os.path.join(path, "rank00001.safetensors"))
    return ["rank00001.safetensors", "checksum"]


def _truncate(path):
    name = os.path.join(path, "rank00000.safetensors")
    with open(name, "r+b") as f:
        f.truncate(os.path.getsize(name) - 10)
    return ["rank00000.safetensors", "truncated"]


def _drop_manifest(path):
    os.remove(os.path.join(path, "manifest.json"))
    return ["manifest.json is missing"]


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate, _drop_manifest])
def test_a_damaged_checkpoint_is_refused_on_every_rank_naming_the_file(tmp_path, damage):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_one, 2, args=(path,))
    words = damage(path)
    messages = run_ranks(_load_must_fail, 2, args=(path, words))
    assert len(messages) == 2


def test_a_checkpoint_of_another_model_names_what_differs(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_one, 2, args=(path,))
    run_ranks(_load_must_fail, 2, args=(path, ["missing from the checkpoint: weight, bias",
                                               "not in the model: embed.weight"], True))
    # strict=False loads what matches, and says what it left out
    model = TiedLM().double()
    model.inp = nn.Linear(8, 17).double()  # another shape
    with pytest.warns(UserWarning, match=r"other shapes: inp\.weight \(16, 8\) -> \(17, 8\)"):
        px.load(path, model=model, strict=False)
    reference = TiedLM().double()
    px.load(path, model=reference)
    assert torch.equal(model.out.weight, reference.out.weight)


# -- crash safety, keep_last, latest_checkpoint -------------------------------------------------
def _save_then_die(path, where):
    """Save `step=2` over the directory of checkpoints, and SIGKILL this process at `where`."""
    import phalanx.checkpoint.saving as api

    model = _model(0)
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2")
    px.save(os.path.join(path, "step1"), model=model, optimizer=opt, step=1)
    kill = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if where == "rank file":
        api.write_tensors = kill
    elif where == "manifest":
        api.json.dump = kill
    elif where == "rename":
        api.fsync_dir = kill
    px.save(os.path.join(path, "step2"), model=model, optimizer=opt, step=2)
    return True


def _save_then_one_rank_dies(path):
    """Rank 1 is SIGKILLed while it writes its file of the second save; rank 0 goes on."""
    import phalanx.checkpoint.saving as saving

    model = _model(0)
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2")
    px.save(os.path.join(path, "step1"), model=model, optimizer=opt, step=1)
    if px.rank() == 1:
        saving.write_tensors = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    px.save(os.path.join(path, "step2"), model=model, optimizer=opt, step=2)
    return True


def test_one_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_save_then_one_rank_dies, 2, args=(str(tmp_path),), timeout=60)
    assert "rank 1" in str(failed.value)
    assert px.latest_checkpoint(tmp_path) == str(tmp_path / "step1")
    assert px.load(tmp_path / "step1", model=_model(3)) == {"step": 1}


@pytest.mark.parametrize("where", ["rank file", "manifest", "rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, where):
    with pytest.raises(RanksFailed):
        run_ranks(_save_then_die, 2, args=(str(tmp_path), where), timeout=60)
    latest = px.latest_checkpoint(tmp_path)
    assert latest == str(tmp_path / "step1")
    model = _model(3)
    assert px.load(latest, model=model) == {"step": 1}
    # the next complete save with keep_last removes what the killed one left
    assert any(".partial-" in entry for entry in os.listdir(tmp_path))
    px.save(tmp_path / "step3", model=model, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step1", "step3"]


def test_keep_last_keeps_the_newest(tmp_path):
    model = _model(0)
    for step in range(4):
        px.save(tmp_path / f"step{step}", model=model, keep_last=2, step=step)
    assert sorted(os.listdir(tmp_path)) == ["step2", "step3"]
    assert px.latest_checkpoint(tmp_path) == str(tmp_path / "step3")
    assert px.latest_checkpoint(tmp_path / "step3" / "nothing-here") is None


def test_phalanx_export_command_writes_weights_the_plain_model_loads(tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file

    model = _model(0)
    px.save(tmp_path / "ckpt", model=model)
    out = tmp_path / "weights.safetensors"
    done = subprocess.run([sys.executable, "-m", "phalanx", "export", str(tmp_path / "ckpt"),
                           str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plain = TiedLM().double()
    plain.load_state_dict(load_file(out))
    tokens = _batch(0)
    assert torch.equal(plain(tokens), model(tokens))
    bad = subprocess.run([sys.executable, "-m", "phalanx", "export", str(tmp_path / "nothing"),
                          str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr == f"phalanx export: error: no checkpoint at {tmp_path / 'nothing'}: " \
                         "not a directory\n"


def _save_loader_midway(path, world_batches):
    """Consume 2 batches of a px.data_loader, save the sampler; or load it and list the rest."""
    dataset = torch.utils.data.TensorDataset(torch.arange(60))
    loader = px.data_loader(dataset, batch_size=12 // px.world_size(), shuffle=True, seed=3)
    if world_batches == "save":
        it = iter(loader)
        seen = [next(it)[0], next(it)[0]]
        px.save(path, sampler=loader.sampler, step=2)
        return torch.cat(seen)
    px.load(path, sampler=loader.sampler)
    return torch.cat([b[0] for b in loader])


def test_the_sampler_resumes_at_the_next_sample_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    before = run_ranks(_save_loader_midway, 2, args=(path, "save"))
    after = run_ranks(_save_loader_midway, 3, args=(path, "rest"))
    seen = torch.cat(before).tolist() + torch.cat(after).tolist()
    assert sorted(seen) == list(range(60))  # every sample once: none skipped, none repeated


def test_checkpoint_info_describes_and_verifies(tmp_path, capsys):
    from phalanx import cli

    model = _model(0)
    opt = _optimizer(model)
    _train(model, opt, 1, 0, 1, 0)
    px.save(tmp_path / "ckpt", model=model, optimizer=opt, step=1)
    assert cli.main(["checkpoint", "info", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "at step 1, 1 rank(s)" in out
    assert "embed.weight" in out and "(11, 8) float64" in out
    assert "head.weight                              (the same tensor as embed.weight)" in out
    assert "optimizer state: exp_avg, exp_avg_sq" in out
    assert "integrity: every file matches its size and CRC-32" in out
    _flip_a_byte_of(tmp_path / "ckpt" / "rank00000.safetensors")
    assert cli.main(["checkpoint", "info", str(tmp_path / "ckpt")]) == 1
    assert "rank00000.safetensors does not match its checksum" in capsys.readouterr().out
    assert cli.main(["checkpoint", "info", str(tmp_path)]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err


def _flip_a_byte_of(name):
    with open(name, "r+b") as f:
        f.seek(os.path.getsize(name) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- saving in the background ---------------------------------------------------------------
def _save_in_background_then_train(path, sync_path):
    torch.manual_seed(0)
    model = _model(0)
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy="zero2")
    _train(model, opt, K, 0, px.world_size(), px.rank())
    px.save(sync_path, model=model, optimizer=opt, step=K)
    import phalanx.checkpoint.saving as saving

    write, started = saving.write_tensors, time.monotonic()

    def late_write(*args):  # the write starts after the training below has changed everything
        time.sleep(max(0.0, started + 2.0 - time.monotonic()))
        return write(*args)

    saving.write_tensors = late_write
    px.save(path, model=model, optimizer=opt, background=True, step=K)
    _train(model, opt, K, K, px.world_size(), px.rank())  # changes what was being saved
    assert time.monotonic() - started < 2.0, "the training did not run before the write"
    px.shutdown()  # waits for the save
    return True


def _load_both(path, sync_path):
    states = []
    for where in (path, sync_path):
        model = _model(50)
        opt = _optimizer(model)
        model, opt = px.prepare(model, opt, strategy="ddp")
        assert px.load(where, model=model, optimizer=opt) == {"step": K}
        states.append(_state(model, opt))
    return states


def test_a_background_save_holds_the_state_of_the_call_while_training_goes_on(tmp_path):
    path, sync_path = str(tmp_path / "background"), str(tmp_path / "sync")
    run_ranks(_save_in_background_then_train, 2, args=(path, sync_path))
    for (bg_params, bg_optim), (params, optim) in run_ranks(_load_both, 3,
                                                            args=(path, sync_path)):
        assert all(torch.equal(bg_params[k], params[k]) for k in params)
        assert all(torch.equal(bg_optim[n][k], optim[n][k]) for n in optim for k in optim[n])


def _background_save_fails(path):
    model = _model(0)
    model, _ = px.prepare(model, None, strategy="ddp")
    px.save(path, model=model, background=True)  # returns: the failure comes later
    try:
        px.save(path + "-next", model=model)
    except px.CheckpointError as exc:
        return str(exc)
    return "no error"


def test_a_background_save_that_fails_raises_at_the_next_call_on_every_rank(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    messages = run_ranks(_background_save_fails, 2, args=(str(blocker / "ckpt"),))
    for message in messages:
        assert "writing the ranks' files failed" in message
        assert "rank 0: NotADirectoryError" in message and "rank 1: NotADirectoryError" in message


# -- across precisions: the masters and the optimizer state survive exactly -------------------
def _save_layout(path, strategy, precision):
    torch.manual_seed(0)
    model = TiedLM()
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    _train(model, opt, K, 0, px.world_size(), px.rank())
    px.save(path, model=model, optimizer=opt)
    px.export(path + ".safetensors", model)
    return px.optimizer_state_dict(opt)


def _load_layout(path, strategy, precision):
    model = TiedLM()
    opt = _optimizer(model)
    model, opt = px.prepare(model, opt, strategy=strategy, precision=precision)
    px.load(path, model=model, optimizer=opt)
    px.export(path + f".{px.world_size()}.safetensors", model)
    return px.optimizer_state_dict(opt)


PRECISION_PAIRS = [(("zero2", 2, "bf16"), ("ddp", 3, "fp32")),
                   (("zero1", 3, "fp32"), ("zero2", 2, "bf16")),
                   (("ddp", 2, "fp16"), ("zero1", 4, "bf16"))]
if os.environ.get("PHALANX_SLOW") == "1":
    PRECISION_PAIRS = [((s1, n1, p1), (s2, n2, p2))
                       for s1 in ("ddp", "zero1", "zero2") for n1 in (1, 2, 3, 4)
                       for p1 in ("fp32", "bf16")
                       for s2, n2, p2 in [("zero2", 3, "bf16"), ("ddp", 2, "fp32")]]


@pytest.mark.parametrize("saved,loaded", PRECISION_PAIRS)
def test_masters_and_optimizer_state_survive_a_change_of_precision_exactly(tmp_path, saved,
                                                                          loaded):
    from safetensors.torch import load_file

    path = str(tmp_path / "ckpt")
    before = run_ranks(_save_layout, saved[1], args=(path, saved[0], saved[2]))[0]
    after = run_ranks(_load_layout, loaded[1], args=(path, loaded[0], loaded[2]))
    exported, reloaded = load_file(path + ".safetensors"), \
        load_file(path + f".{loaded[1]}.safetensors")
    assert exported.keys() == reloaded.keys()
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(loaded[2])
    for key, value in exported.items():
        if key.startswith("frozen.") and compute is not None:
            # a frozen parameter has no master: under bf16/fp16 it is held in that dtype
            value = value.to(compute).float()
        assert torch.equal(reloaded[key], value), key  # trained: the fp32 masters, exactly
    for state in after:
        assert state["state"].keys() == before["state"].keys()
        for index, entry in before["state"].items():
            for key, value in entry.items():
                assert torch.equal(state["state"][index][key], value), (index, key)
