"""Offload in the plan, and the question users ask: an 8B model on two 24 GB cards. Every figure
is computed by hand from the [Note: offload in the plan] in planner/offload.py and the engine's
unit sizes (engine/units.py: a 25 MiB bucket of bf16 is 13,107,200 elements, the first unit
1 MiB, and the step makes fp32 gradients four buckets at a time). Under zero2 and zero3 each
reduced gradient shard goes to the host as it is made: the device holds two units' shards, the
host the whole gradient shard."""

import json

import pytest

import phalanx as px
from phalanx.cli import main as phalanx_main
from phalanx.planner.layout import unit_sizes

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)

PSI = 8 * 10**9
OWN = PSI // 2                      # the shard each of 2 ranks steps
BUCKET = 13_107_200                 # elements of a 25 MiB bf16 unit
UNITS = len(unit_sizes(None, PSI, 2, 25.0))
# The host step takes runs of four units' shards (4 x 25 MiB of fp32 gradients; the first run
# holds the 1 MiB unit and three full ones), 4 x 6,553,600 elements the largest of each.
RUN = 4 * (BUCKET // 2)
RUNS = 1 + -(-(UNITS - 4) // 4)
# per rank (engine/offload.py): fp32 masters (4) and AdamW's two fp32 moments (8) of its shard;
# two landing buffers of a run's bf16 gradients (the run stepping, the next landing); one run's
# gradients widened to fp32; two units' bf16 staging buffers for the copies up
STAGING = 2 * 2 * (BUCKET // 2)
HOST = 12 * OWN + 2 * 2 * RUN + 4 * RUN + STAGING     # zero1: two landing buffers of a run
HOST_SHARDED = 12 * OWN + 2 * OWN + 4 * RUN + STAGING  # zero2/zero3: the whole bf16 grad shard
PAIR = 2 * (BUCKET // 2)  # two consecutive units' gradient shards, on the device
COMPUTE_S = 6 * PSI * 2048 / (71e12 * 0.4)  # a bare count: 6 x params x tokens, RTX 3090 bf16


def _plan(**options):
    return px.plan(params=PSI, gpus=2, gpu="rtx3090", precision="bf16", optimizer="adamw",
                   **options)


def test_offloading_the_optimizer_leaves_weights_and_gradients_on_the_device():
    r = _plan(offload="optimizer", host_memory="128GB")
    assert list(r.strategies) == ["zero1", "zero2", "zero3"]  # ddp's state is not sharded
    z3 = r["zero3"]
    assert (z3.params_bytes, z3.grads_bytes, z3.optimizer_bytes) == (2 * OWN, 2 * PAIR, 0)
    assert z3.step_working_bytes == 0  # the step runs on the host
    assert (r["zero2"].params_bytes, r["zero2"].grads_bytes) == (2 * PSI, 2 * PAIR)
    # zero1 keeps its full gradients (it all-reduces them), and lands a run at a time
    assert r["zero1"].grads_bytes == 2 * PSI and r["zero1"].host_bytes == HOST
    assert z3.host_bytes == HOST_SHARDED and z3.host_bytes_per_node == 2 * HOST_SHARDED
    # the gradients on the host, zero2's whole bf16 weights fit too, and it communicates less
    assert z3.fits_host and r.recommended == "zero2"
    # the link: bf16 gradients of the shard down, its updated bf16 weights up, PCIe 4.0 x16
    assert z3.host_transfer_bytes == 2 * OWN + 2 * OWN
    assert z3.host_transfer_s == pytest.approx(2 * OWN / 32e9)
    # the host step streams master and moments (read and written), the bf16 gradient, its
    # fp32 copy (written and read) and the new bf16 weights: 2 x 12 + 2 + 8 + 2 bytes per
    # element, for both ranks of the node, at two channels of DDR4-3200
    assert z3.host_step_s == pytest.approx(2 * 36 * OWN / 51.2e9)
    # the pipeline after the backward, a run at a time: the host step is the slowest stage,
    # and the first run's copy down and the last run's copy up are exposed beside it
    plain = _plan()["zero3"]
    exposed = z3.host_step_s + 2 * z3.host_transfer_s / RUNS
    assert z3.compute_time_s == pytest.approx(COMPUTE_S)
    assert z3.step_time_s == pytest.approx(plain.step_time_s + exposed)
    assert z3.comm_bytes_per_step == plain.comm_bytes_per_step


def test_offloading_zero3_parameters_too():
    r = _plan(offload="params")
    assert list(r.strategies) == ["zero3"]
    z3 = r["zero3"]
    assert (z3.params_bytes, z3.grads_bytes, z3.optimizer_bytes) == (0, 2 * PAIR, 0)
    # no staging (the update stays on the host), the bf16 shard kept there between uses
    assert z3.host_bytes == HOST_SHARDED - STAGING + 2 * OWN
    # gradients down; each gather (forward, and backward again: a count keeps nothing)
    # uploads the shard first; the updated shard stays on the host
    assert z3.host_transfer_bytes == 2 * OWN + 2 * (2 * OWN)
    assert z3.host_transfer_s == pytest.approx(3 * 2 * OWN / 32e9)
    assert z3.fits_host is None  # no --host-memory: not checked, and said so
    assert any("host memory not checked" in n for n in r.notes)


def test_host_memory_is_checked_and_named_when_short():
    r = _plan(offload="optimizer", host_memory="64GB")
    assert r.recommended is None and r["zero3"].fits_host is False
    assert f"zero3 needs {2 * HOST_SHARDED / 1e9:.1f} GB of host memory per node" in r.reason
    assert "57.6 GB of host memory per node" in r.reason  # 90% of 64 GB
    params = next(a for a in r.alternatives if a.change == {"offload": "params"})
    assert not params.fits and "does not fit either" in params.line


@pytest.mark.parametrize("options,message", [
    ({"offload": "optimizer", "strategy": "ddp"}, "ddp steps the whole optimizer"),
    ({"offload": "params", "strategy": "zero2"}, "only zero3 keeps parameter shards"),
    ({"offload": "disk"}, "unknown offload 'disk'"),
    ({"offload": "optimizer", "host_memory": "128"}, "has no unit"),
])
def test_bad_offload_options_are_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        _plan(**options)


def _run(capsys, *argv):
    code = phalanx_main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.parametrize("device", [["--gpu-memory", "24GB"], ["--gpu", "rtx3090"]])
def test_8b_on_two_24gb_cards_names_what_fits_and_why_the_rest_does_not(capsys, device):
    argv = ["--params", "8e9", "--gpus", "2", *device]
    data = json.loads(_run(capsys, *argv, "--json"))
    assert data["recommended"] is None
    # a full fine-tune: bf16 weights and gradients and 12 bytes of fp32 state per parameter,
    # 16 x 8e9 under ddp, 4 + 12/2 under zero1, 2 + 14/2 under zero2, 14/2 under zero3 (its
    # fp32 master is the shard: no bf16 copy of it is kept between uses)
    states = {"ddp": 16 * PSI, "zero1": 10 * PSI, "zero2": 9 * PSI, "zero3": 7 * PSI}
    for name, bytes_ in states.items():
        entry = data["strategies"][name]
        assert entry["params_bytes"] + entry["grads_bytes"] + entry["optimizer_bytes"] == bytes_
        assert f"{name} needs {entry['total_bytes'] / 1e9:.1f} GB" in data["reason"]
    assert "2 + 2 + 12 bytes of weights, gradients and optimizer state" in data["reason"]
    lean, lora, offload = data["alternatives"]
    # first the same full fine-tune in less memory: bf16 everywhere (2 bytes of weights), the
    # moments 8-bit (2 x (1 + 4/256) bytes), each unit stepped in backward (two units'
    # gradient shards): zero3 holds half of 4.03 bytes per parameter
    assert lean["change"] == {"precision": "bf16-true", "optimizer": "adamw8bit",
                              "step_in_backward": True}
    assert list(lean["fits"]) == ["zero3"]
    assert (2 + 2 * (1 + 4 / 256)) * PSI / 2 < lean["fits"]["zero3"] < 16.5e9
    # LoRA rank 8 on q_proj and v_proj of the stand-in shape (34 layers of 4428)
    adapters = 34 * 2 * 2 * 8 * 4428
    assert lora["change"] == {"lora_rank": 8, "lora_targets": ["q_proj", "v_proj"]}
    assert lora["trainable_params"] == adapters
    z3_states = (2 * (PSI + adapters) + 2 * adapters + 12 * adapters) // 2
    assert z3_states < lora["fits"]["zero3"] < z3_states + 0.1e9
    assert set(lora["fits"]) == {"ddp", "zero1", "zero2", "zero3"}  # no activations counted
    # a full fine-tune with the optimizer offloaded, its gradients too: zero2 (whole bf16
    # weights) and zero3, and the host memory they need; zero1 keeps its full gradients
    assert offload["change"] == {"offload": "optimizer"}
    assert list(offload["fits"]) == ["zero2", "zero3"]
    assert offload["host_bytes_per_node"]["zero3"] == 2 * HOST_SHARDED
    assert offload["too_big"]["zero1"] > 0.9 * 24e9  # whole bf16 weights and gradients
    text = _run(capsys, *argv)
    assert "what fits instead" in text
    assert "zero3 (8.1 GB) per device" in text and "zero3 leaves the most room" in text
    assert ("a full fine-tune with the optimizer offloaded (offload='optimizer'): fits under "
            f"zero2 (16.1 GB per device, {2 * HOST_SHARDED / 1e9:.1f} GB of pinned host memory "
            "per node), zero3 (8.2 GB per device") in text


def test_with_activations_the_8b_full_fine_tune_fits_with_the_optimizer_and_gradients_offloaded():
    """A Llama-3.1-8B-shaped config at 2048 tokens with activation checkpointing: zero3 with the
    optimizer offloaded holds 8 GB of weights, two units' gradient shards (the rest went to the
    host as they were made) and the activations."""
    config = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "tie_word_embeddings": False}
    r = px.plan(config=config, gpus=2, gpu="rtx3090", seq=2048, attention="flash",
                activation_checkpointing=True)
    by_change = {tuple(a.change.values())[0]: a for a in r.alternatives}
    assert "zero3" in by_change[8].fits and "ddp" in by_change[8].fits
    assert list(by_change["optimizer"].fits) == ["zero3"]
    assert round(by_change["optimizer"].fits["zero3"] / 1e9, 1) == 15.3
    assert round(by_change["optimizer"].host_bytes_per_node["zero3"] / 1e9, 1) == 115.6
    assert "params" not in by_change  # the optimizer's offload is enough
    # what zero3 holds with the optimizer offloaded: half the bf16 weights, and of the
    # gradients the two largest consecutive units' shards in backward's order: the first
    # block's q_proj (4096 x 4096, registered first in a Llama layer, so made last) and the
    # embedding's (128256 x 4096, alone in its unit), halved, in bf16
    z3 = px.plan(config=config, gpus=2, gpu="rtx3090", seq=2048, attention="flash",
                 activation_checkpointing=True, offload="optimizer")["zero3"]
    params = r.model["params"]
    assert z3.params_bytes == params  # 2 bytes x params / 2
    assert z3.grads_bytes == 2 * (128256 * 4096 + 4096 * 4096) // 2
    # the whole bf16 gradient shard (2 x params / 2) kept on the device would not fit
    assert z3.total_bytes < 0.9 * 24e9 < z3.total_bytes - z3.grads_bytes + params


def test_the_consumer_presets_use_their_own_figures():
    # dense bf16 with fp32 accumulation: RTX 3090 71, RTX 4090 165.2, RTX A6000 154.8 TFLOP/s
    for gpu, tflops, memory in (("rtx3090", 71.0, 24e9), ("rtx4090", 165.2, 24e9),
                                ("a6000", 154.8, 48e9)):
        r = px.plan(params=1e9, gpus=2, gpu=gpu, seq=1024)
        assert r.setting["gpu_memory_bytes"] == memory
        assert r["ddp"].compute_time_s == pytest.approx(6e9 * 1024 / (tflops * 1e12 * 0.4))
        assert r.setting["host_link_GBps"] == 32.0  # PCIe 4.0 x16
