"""Lightning's checkpoints under `PhalanxStrategy`: `ModelCheckpoint` writes phalanx checkpoints
(px.save), `trainer.fit(ckpt_path=...)` resumes from them exactly, also under another phalanx
strategy and from a `.ckpt` file that DDPStrategy wrote, and `px.load` reads them into a plain
model. 2 CPU ranks, float64, Lightning's BoringModel as it ships.
"""

from __future__ import annotations

import os

import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is not installed: pip install "
                        "-e '.[lightning]' (CI installs it through the test extra)")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx.integrations.lightning import PhalanxStrategy  # noqa: E402
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
