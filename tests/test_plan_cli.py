"""`phalanx plan` and `px.plan`: the JSON keys, the table, models from factories, and one-line
errors for bad input."""

import json
import textwrap
from pathlib import Path

import pytest

import phalanx as px
from phalanx.cli import main as phalanx_main

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)

STRATEGY_KEYS = {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                 "buffers_bytes", "total_bytes", "fits", "comm_bytes_per_step", "step_time_s",
                 "scaling_efficiency"}

GPT2_SMALL = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
              "n_positions": 1024, "vocab_size": 50257, "attn_pdrop": 0.1, "resid_pdrop": 0.1,
              "embd_pdrop": 0.1}


def run(capsys, *argv):
    code = phalanx_main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_every_key_for_every_strategy(capsys):
    code, out, _ = run(capsys, "--params", "8e9", "--gpus", "8", "--gpu-memory", "80GB",
                       "--precision", "fp32", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data["strategies"]) == {"ddp", "zero1", "zero2", "zero3"}
    for name, entry in data["strategies"].items():
        assert STRATEGY_KEYS <= set(entry), name
        # the peak: not everything is alive at once, but model states always are
        states = entry["params_bytes"] + entry["grads_bytes"] + entry["optimizer_bytes"]
        assert states < entry["total_bytes"] <= (states + entry["buffers_bytes"]
                                                 + entry["activations_bytes"]
                                                 + entry["step_working_bytes"])
        assert entry["peak_at"] in ("backward start", "end of backward", "optimizer step")
    assert "recommended" in data and data["recommended"] in data["strategies"]
    assert data["strategies"]["ddp"]["params_bytes"] == 32e9
    assert data["strategies"]["ddp"]["fits"] is False


def test_json_equals_the_python_result(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2_SMALL))
    code, out, _ = run(capsys, "--config", str(path), "--gpus", "4", "--batch", "8", "--json")
    assert code == 0
    result = px.plan(config=str(path), gpus=4, batch=8)
    assert json.loads(out) == json.loads(result.to_json())


def test_single_strategy_and_table(capsys):
    code, out, _ = run(capsys, "--params", "7.5B", "--gpus", "64", "--strategy", "zero2",
                       "--units", "GiB")
    assert code == 0
    assert "zero2" in out and "zero3" not in out.split("recommended")[0]
    for row in ("parameters", "gradients", "optimizer state", "activations", "buffers", "total",
                "communication per device", "step time, overlapped", "step time, no overlap",
                "scaling efficiency", "recommended:"):
        assert row in out
    assert "GiB = 2^30" in out


def test_comm_volume_over_a_ring_per_strategy():
    # ddp: one all-reduce (2x); zero2: reduce-scatter + all-gather of the update (2x);
    # zero1 keeps full gradients, so all-reduce + all-gather (3x); zero3 gathers twice (3x).
    n, psi = 8, 1_000_000_000
    r = px.plan(params=psi, gpus=n, precision="bf16")
    grad_bytes = 2 * psi
    ring = (n - 1) / n
    for name, times in (("ddp", 2), ("zero1", 3), ("zero2", 2), ("zero3", 3)):
        assert r[name].comm_bytes_per_step == pytest.approx(times * ring * grad_bytes), name
    assert px.plan(params=psi, gpus=1)["ddp"].comm_bytes_per_step == 0


def test_more_bandwidth_never_slows_a_step_and_nodes_use_the_slower_link():
    fast = px.plan(params=1e9, gpus=8, intra_node_bw="nvlink4")
    slow = px.plan(params=1e9, gpus=8, intra_node_bw="pcie4")
    for name in fast.strategies:
        assert fast[name].comm_time_s < slow[name].comm_time_s
        assert fast[name].step_time_s <= slow[name].step_time_s
        assert fast[name].scaling_efficiency >= slow[name].scaling_efficiency
    two_nodes = px.plan(params=1e9, gpus=4, nodes=2, intra_node_bw="nvlink4",
                        inter_node_bw="eth-25g")
    assert two_nodes.setting["bandwidth_GBps"] == 3.125
    assert two_nodes.setting["world_size"] == 8


def test_factory_is_built_on_meta_device(tmp_path, capsys):
    # ~1.07e9 parameters: far more than a test may allocate, free on the meta device.
    (tmp_path / "big.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(1000, 8192)
                self.blocks = nn.ModuleList(nn.Linear(8192, 8192) for _ in range(16))

            def forward(self, ids):
                x = self.embed(ids)
                for b in self.blocks:
                    x = torch.relu(b(x))
                return x

        def build():
            return Net()
    """))
    code, out, _ = run(capsys, "--model", f"{tmp_path / 'big.py'}:build", "--gpus", "8",
                       "--seq", "128", "--json")
    assert code == 0
    data = json.loads(out)
    expected = 1000 * 8192 + 16 * (8192 * 8192 + 8192)
    assert data["model"]["params"] == expected
    acts = data["strategies"]["ddp"]["activations_bytes"]
    # bf16, 128 tokens: the embedding output and each ReLU's output (which is also the next
    # Linear's input: one storage), the int64 ids, the fp32 loss-sized tensor, and two more
    # of those for the loss's gradients at the start of backward
    assert acts == (16 + 1) * 128 * 8192 * 2 + 128 * 8 + 3 * 128 * 8192 * 4


@pytest.mark.parametrize("argv,message", [
    (["--params", "8x"], "cannot read parameter count '8x'"),
    (["--params", "8e9", "--gpu-memory", "80"], "has no unit"),
    (["--params", "8e9", "--gpu-memory", "80XB"], "unknown unit"),
    (["--params", "8e9", "--intra-node-bw", "nvlink9"], "unknown intra-node bandwidth 'nvlink9'"),
    (["--params", "8e9", "--gpu", "h900"], "unknown GPU preset 'h900'"),
    (["--params", "8e9", "--strategy", "zero4"], "unknown strategy 'zero4'"),
    (["--params", "8e9", "--precision", "fp8"], "unknown precision 'fp8'"),
    (["--params", "8e9", "--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["--params", "8e9", "--gpus", "0"], "gpus must be a positive integer"),
    ([], "describe the model exactly once"),
    (["--params", "1e9", "--model", "x.py:f"], "describe the model exactly once"),
    (["--model", "no_colon"], "must be PATH:FUNCTION"),
    (["--model", "/nonexistent/m.py:build"], "does not exist"),
    (["--config", "/nonexistent/config.json"], "does not exist"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert message in err


def test_config_missing_a_field_and_a_failing_factory_are_one_line(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}))
    code, _, err = run(capsys, "--config", str(cfg))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "missing the layers size" in err and "num_hidden_layers" in err
    cfg.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "vocab_size": 10}))
    code, _, err = run(capsys, "--config", str(cfg))
    assert code == 2 and "no intermediate (MLP) size" in err
    cfg.write_text("{not json")
    code, _, err = run(capsys, "--config", str(cfg))
    assert code == 2 and "not valid JSON" in err

    (tmp_path / "bad.py").write_text("def build():\n    raise RuntimeError('no GPU here\\nmore')\n"
                                     "def three():\n    return 3\n")
    code, _, err = run(capsys, "--model", f"{tmp_path / 'bad.py'}:build")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "model factory" in err and "RuntimeError: no GPU here" in err
    code, _, err = run(capsys, "--model", f"{tmp_path / 'bad.py'}:three")
    assert code == 2 and "returned int, not a torch.nn.Module" in err
    code, _, err = run(capsys, "--model", f"{tmp_path / 'bad.py'}:missing")
    assert code == 2 and "has no function 'missing'" in err


def test_recommendation_is_what_fits_and_communicates_least():
    r = px.plan(params=7.5e9, gpus=64, precision="bf16", gpu_memory="80GB")
    assert not r["ddp"].fits_with_headroom and r["zero1"].fits_with_headroom
    # zero1 fits too, but moves 3x the gradients' bytes where zero2 moves 2x
    assert r["zero2"].comm_bytes_per_step < r["zero1"].comm_bytes_per_step
    assert r.recommended == "zero2"
    assert "ddp needs" in r.reason and "communicates least" in r.reason
    assert px.plan(params=1e8, gpus=8, gpu_memory="80GB").recommended == "ddp"
    none = px.plan(params=2e11, gpus=8, gpu_memory="80GB")
    assert none.recommended is None and "would fit on" in none.reason
    needed = int(none.reason.split("would fit on ")[1].split()[0])
    assert px.plan(params=2e11, gpus=needed, gpu_memory="80GB")["zero3"].fits_with_headroom
    assert not px.plan(params=2e11, gpus=needed - 1, gpu_memory="80GB")["zero3"].fits_with_headroom


def test_blocks_names_the_repeated_layers_of_a_factory(capsys):
    """`--blocks Layer`: zero3 gathers one layer and prefetches the next (32 * 64 * 2 + 96
    parameters each, in fp32), not the whole model at once."""
    factory = f"{Path(__file__).parent / 'test_zero3_gather.py'}:Sequential4"
    gathered = {}
    for extra in ([], ["--blocks", "Layer"]):
        code, out, err = run(capsys, "--model", factory, "--input-shape", "8", "--gpus", "2",
                             "--precision", "fp32", "--strategy", "zero3", "--json", *extra)
        assert code == 0, err
        entry = json.loads(out)["strategies"]["zero3"]
        gathered[bool(extra)] = entry["buffers_detail"]["gathered_params"]
    layer = 32 * 64 * 2 + 64 + 32
    assert gathered[True] == 2 * layer * 4
    assert gathered[False] == (8 * 32 + 32 + 4 * layer + 32 * 3 + 3) * 4  # one root: the model
    code, _, err = run(capsys, "--params", "1e9", "--blocks", "Layer")
    assert code != 0 and "--blocks goes with --model" in err


def test_blocks_with_a_description_already_made_is_refused():
    from phalanx.planner.model_desc import from_count
    with pytest.raises(ValueError, match="blocks goes where the model is described"):
        px.plan(from_count(1e9), gpus=2, blocks="Layer")


def test_zero3_gathering_options_change_the_plan(capsys):
    """--prefetch 0 gathers one layer at a time; --keep-until-backward keeps every layer from
    its forward to its backward, so all are gathered at once and backward gathers nothing
    again (one all-gather of the parameters per step, not two)."""
    factory = f"{Path(__file__).parent / 'test_zero3_gather.py'}:Sequential4"
    layer, total = 32 * 64 * 2 + 64 + 32, 8 * 32 + 32 + 4 * (32 * 64 * 2 + 64 + 32) + 32 * 3 + 3
    entries = {}
    for extra in ([], ["--prefetch", "0"], ["--keep-until-backward"]):
        code, out, err = run(capsys, "--model", factory, "--input-shape", "8", "--gpus", "2",
                             "--precision", "fp32", "--strategy", "zero3", "--json",
                             "--blocks", "Layer", *extra)
        assert code == 0, err
        entries[tuple(extra)] = json.loads(out)["strategies"]["zero3"]
    gathered = {k: v["buffers_detail"]["gathered_params"] for k, v in entries.items()}
    assert gathered[()] == 2 * layer * 4 and gathered[("--prefetch", "0")] == layer * 4
    assert gathered[("--keep-until-backward",)] == total * 4
    gathers = {k: v["comm_payload_bytes"]["all_gather"] for k, v in entries.items()}
    assert gathers[("--keep-until-backward",)] == total * 4
    assert gathers[()] == (2 * total - (32 * 3 + 3)) * 4  # the head, last to run, is kept


def test_help_gives_every_default():
    import argparse

    from phalanx.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    quiet = [action.option_strings for action in sub.choices["plan"]._actions
             if action.default not in (None, False, argparse.SUPPRESS)
             and f"default {action.default}" not in (action.help or "")
             and "(default" not in (action.help or "")]
    assert not quiet, f"phalanx plan --help gives no default for {quiet}"
    help_text = " ".join(sub.choices["plan"].format_help().split())
    assert "or all (default all)" in help_text and "(default bf16)" in help_text


def test_a_device_given_its_own_figures_is_not_named_for_the_preset(capsys):
    for extra, device in (([], "2 x H100 SXM (80.00 GB)"),
                          (["--gpu-memory", "24GB"], "2 x GPU with H100 SXM's compute (24.00 GB)"),
                          (["--peak-tflops", "100"], "2 x GPU with H100 SXM's memory (80.00 GB)"),
                          (["--gpu-memory", "24GB", "--peak-tflops", "100"], "2 x GPU (24.00 GB)"),
                          (["--gpu", "a10", "--gpu-memory", "24GB"], "2 x A10 (24.00 GB)")):
        code, out, err = run(capsys, "--params", "1e9", "--gpus", "2", *extra)
        assert code == 0, err
        assert out.splitlines()[1].startswith(f"  {device} on 1 node(s)"), (extra, out)
