"""A Lightning script under `PhalanxStrategy`, started the two ways a user starts one: as
`python train.py` (Lightning's own launcher starts the second process) and as
`phalanx run -n 2 train.py` (the elastic agent starts both; Lightning reads the torchrun
variables). Each process says it was one of two ranks, and the checkpoint, read back with
px.load, holds to the last bit what the same script writes on two forked ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("lightning", reason="Lightning is not installed: pip install "
                    "-e '.[lightning]' (CI installs it through the test extra)")

from lightning.pytorch.demos.boring_classes import BoringModel

import phalanx as px
from phalanx.testing import run_ranks

SCRIPT = textwrap.dedent('''
    import sys
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    import phalanx as px
    from phalanx.integrations.lightning import PhalanxStrategy

    L.seed_everything(0)
    model = BoringModel()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PhalanxStrategy("zero3"),
                        precision="64-true", max_steps=3, limit_val_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model)
    trainer.save_checkpoint(sys.argv[1])
    print(f"rank {px.rank()} of {px.world_size()}", flush=True)
''')


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def _weights(path: str) -> dict:
    model = BoringModel().double()
    px.load(path, model=model)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _in_process(script: str, out: str) -> None:
    """The script as a rank of run_ranks (forked: no second import of torch)."""
    import runpy

    sys.argv = [script, out]
    runpy.run_path(script, run_name="__main__")


def _launch(name: str, tmp_path) -> None:
    """Run train.py as `name` starts it, and compare its checkpoint with a forked run."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / name.replace(" ", "-")
    command = {"python": [sys.executable, str(script)],
               "phalanx run": [os.path.join(os.path.dirname(sys.executable), "phalanx"), "run",
                               "-n", "2", str(script)]}[name]
    done = subprocess.run(command + [str(out)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=240, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name}:\n{output[-4000:]}"
    assert "rank 0 of 2" in output and "rank 1 of 2" in output, f"{name}:\n{output[-4000:]}"
    run_ranks(_in_process, world_size=2, args=(str(script), str(tmp_path / "forked")),
              timeout=120)
    launched, forked = run_ranks(lambda: [_weights(str(p)) for p in (out, tmp_path / "forked")],
                                 world_size=1, timeout=60)[0]
    assert launched["layer.weight"].dtype == torch.float64
    assert launched.keys() == forked.keys()
    assert all(torch.equal(launched[k], forked[k]) for k in launched), name


def test_phalanx_run_starts_a_lightning_script(tmp_path):
    _launch("phalanx run", tmp_path)


@pytest.mark.slow  # docs/guides/integrations/lightning.md's example starts it this way too
def test_lightning_launcher_starts_the_second_process(tmp_path):
    _launch("python", tmp_path)
