"""Lightning's checkpoints under `PhalanxStrategy`: `ModelCheckpoint` writes phalanx checkpoints
(px.save), `trainer.fit(ckpt_path=...)` resumes from them exactly, also under another phalanx
strategy and from a `.ckpt` file that DDPStrategy wrote, and `px.load` reads them into a plain
model. 2 CPU ranks, float64, Lightning's BoringModel as it ships. `load_from_checkpoint` reads
such a directory in one process, after `import phalanx.integrations.lightning`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is not installed: pip install "
                        "-e '.[lightning]' (CI installs it through the test extra)")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx.integrations.lightning import PhalanxStrategy  # noqa: E402
from phalanx.integrations.lightning.checkpoints import lightning_dictionary  # noqa: E402
from phalanx.testing import run_ranks  # noqa: E402

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def _fit(strategy, directory: str, epochs: int, ckpt_path=None, keep: int = -1):
    """BoringModel for `epochs` epochs of 2 optimizer steps (4 batches, accumulated in pairs),
    a checkpoint at the end of each; returns the model, the trainer and its checkpoints."""
    torch.manual_seed(0)
    model = BoringModel()
    saver = ModelCheckpoint(dirpath=directory, save_top_k=keep, every_n_epochs=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="64-true",
                        max_epochs=epochs, limit_train_batches=4, limit_val_batches=2,
                        accumulate_grad_batches=2, callbacks=[saver], **QUIET)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer, sorted(os.listdir(directory))


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _checkpoint_job(root: str) -> dict:
    out = {}
    model, trainer, saved = _fit(PhalanxStrategy("zero3"), f"{root}/straight", 2, keep=1)
    out["straight"], out["straight_saved"] = _weights(model), saved
    out["straight_lr"] = trainer.optimizers[0].param_groups[0]["lr"]

    model, _, saved = _fit(PhalanxStrategy("zero3"), f"{root}/first", 1)
    out["epoch0"], out["first_saved"] = _weights(model), saved
    first = f"{root}/first/{saved[0]}"
    plain = BoringModel().double()
    out["px_load_values"] = px.load(first, model=plain)
    out["px_loaded"] = _weights(plain)

    # evaluation of a model never fitted: replicated, with the checkpoint's values
    fresh = BoringModel()
    L.Trainer(accelerator="cpu", devices=2, strategy=PhalanxStrategy("zero3"),
              precision="64-true", limit_val_batches=2, **QUIET).validate(fresh, ckpt_path=first,
                                                                          verbose=False)
    out["validated"] = _weights(fresh)

    model, trainer, _ = _fit(PhalanxStrategy("zero2"), f"{root}/resumed", 2, ckpt_path=first)
    out["resumed"] = _weights(model)
    out["resumed_lr"] = trainer.optimizers[0].param_groups[0]["lr"]

    _, _, saved = _fit(DDPStrategy(), f"{root}/ddp", 1)
    model, _, _ = _fit(PhalanxStrategy("zero3"), f"{root}/from-ddp", 2,
                       ckpt_path=f"{root}/ddp/{saved[0]}")
    out["from_ddp"] = _weights(model)
    return out


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_modelcheckpoint_and_resume(tmp_path):
    ranks = run_ranks(_checkpoint_job, world_size=2, args=(str(tmp_path),), timeout=300)
    out = ranks[0]
    # save_top_k=1: ModelCheckpoint removed the first epoch's checkpoint directory
    assert out["straight_saved"] == ["epoch=1-step=4.ckpt"]
    assert out["first_saved"] == ["epoch=0-step=2.ckpt"]
    first = tmp_path / "first" / "epoch=0-step=2.ckpt"
    assert (first / "manifest.json").is_file()  # a phalanx checkpoint directory
    # px.load reads it into a plain model: the weights at the end of the first epoch, and
    # Lightning's own state beside them
    assert _max_difference(out["px_loaded"], out["epoch0"]) == 0
    assert _max_difference(out["validated"], out["epoch0"]) == 0
    assert out["px_load_values"]["lightning"]["epoch"] == 0
    assert out["px_load_values"]["lightning"]["global_step"] == 2
    # the resumed runs end where the uninterrupted one ends, the scheduler too
    assert _max_difference(out["epoch0"], out["straight"]) > 1e-3  # the second epoch trains
    assert _max_difference(out["resumed"], out["straight"]) < 1e-12
    assert out["resumed_lr"] == out["straight_lr"] == pytest.approx(0.1 * 0.1**2)
    assert _max_difference(out["from_ddp"], out["straight"]) < 1e-12
    assert _max_difference(ranks[1]["resumed"], out["resumed"]) == 0


class WithHyperParameters(BoringModel):
    """BoringModel with a hyper-parameter, saved as Lightning saves them."""

    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _fit_for_loading(directory: str) -> dict:
    torch.manual_seed(0)
    model = WithHyperParameters(lr=0.2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PhalanxStrategy("zero3"),
                        precision="64-true", max_epochs=1, limit_train_batches=3,
                        limit_val_batches=1, callbacks=[ModelCheckpoint(dirpath=directory)],
                        **QUIET)
    trainer.fit(model)
    return _weights(model)


# a process of its own, as a script that evaluates a trained model: Lightning reads a phalanx
# checkpoint directory once the integration is imported
LOADING = """
import sys, torch
from lightning.pytorch.demos.boring_classes import BoringModel
try:
    BoringModel.load_from_checkpoint(sys.argv[1])
except IsADirectoryError:
    print("IsADirectoryError before the import")
import phalanx.integrations.lightning
torch.save(BoringModel.load_from_checkpoint(sys.argv[1]).state_dict(), sys.argv[2])
"""


def test_load_from_checkpoint_reads_a_phalanx_directory(tmp_path):
    trained = run_ranks(_fit_for_loading, world_size=2, args=(str(tmp_path / "run"),),
                        timeout=300)[0]
    (saved,) = os.listdir(tmp_path / "run")
    path = str(tmp_path / "run" / saved)
    assert os.path.isfile(os.path.join(path, "manifest.json"))
    loaded = WithHyperParameters.load_from_checkpoint(path)
    assert loaded.hparams.lr == 0.2  # the hyper-parameters the Trainer saved
    # zero3's two shards, joined, in the module's own dtype (float32: "64-true" cast the model
    # in the Trainer, and load_from_checkpoint builds it anew), on the CPU
    assert loaded.layer.weight.dtype == torch.float32 and loaded.device.type == "cpu"
    assert _max_difference(_weights(loaded), _float32(trained)) == 0
    assert WithHyperParameters.load_from_checkpoint(path, lr=0.5).hparams.lr == 0.5
    # weights_only=True unpickles nothing: the weights, and the module's own defaults
    alone = WithHyperParameters.load_from_checkpoint(path, weights_only=True)
    assert alone.hparams.lr == 0.1
    assert _max_difference(_weights(alone), _float32(trained)) == 0
    on_meta = lightning_dictionary(path, map_location=torch.device("meta"))["state_dict"]
    assert {v.device.type for v in on_meta.values()} == {"meta"}
    with pytest.raises(IsADirectoryError):  # a directory that is not a phalanx checkpoint
        WithHyperParameters.load_from_checkpoint(str(tmp_path / "run"))

    done = subprocess.run([sys.executable, "-c", LOADING, path, str(tmp_path / "loaded.pt")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "IsADirectoryError before the import" in done.stdout
    elsewhere = torch.load(tmp_path / "loaded.pt")
    assert _max_difference(elsewhere, _float32(trained)) == 0


def _float32(weights: dict) -> dict:
    return {k: v.float() for k, v in weights.items()}
