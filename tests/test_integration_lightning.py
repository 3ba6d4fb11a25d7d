"""`PhalanxStrategy` under `lightning.Trainer`, against Lightning's own DDPStrategy.

Every case runs Lightning's demo models as Lightning ships them (BoringModel, the Transformer
demo of lightning.pytorch.demos) on 2 CPU ranks in float64 (`precision="64-true"`, which
PhalanxStrategy maps to phalanx's fp32 on a float64 model), once under DDPStrategy and once
under PhalanxStrategy with ddp, zero2 and zero3, in the same job: the weights after fit, what
`self.log(..., sync_dist=True)` logged in the training, validation and test loops, and the
learning rate the scheduler left must agree to float64 round-off. The runs accumulate
(`accumulate_grad_batches=2`) and clip (`gradient_clip_val`, small enough to clip: a run
without it ends elsewhere, checked too). And torch's LR scheduler warns of no step out of order
where the scheduler is built before phalanx prepares the optimizer (Lightning's order).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

L = pytest.importorskip("lightning", reason="Lightning is not installed: pip install "
                        "-e '.[lightning]' (CI installs it through the test extra)")

from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from lightning.pytorch.demos.transformer import LightningTransformer, WikiText2  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from phalanx.integrations.lightning import PhalanxStrategy  # noqa: E402
from phalanx.testing import run_ranks  # noqa: E402

KINDS = ("ddp", "zero2", "zero3")
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


class LoggedBoring(BoringModel):
    """The demo model as it is, plus the logging a user adds: each loop's loss, averaged over
    the ranks with sync_dist=True."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], sync_dist=True)
        return out

    def validation_step(self, batch, batch_idx):
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"], sync_dist=True)
        return out

    def test_step(self, batch, batch_idx):
        out = super().test_step(batch, batch_idx)
        self.log("test_loss", out["y"], sync_dist=True, reduce_fx="max")
        return out


def _strategy(kind: str):
    return DDPStrategy() if kind == "lightning-ddp" else PhalanxStrategy(kind)


def _boring(kind: str, clip: float | None = 0.05) -> dict:
    torch.manual_seed(0)
    model = LoggedBoring()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(kind),
                        precision="64-true", max_epochs=2, limit_train_batches=4,
                        limit_val_batches=3, limit_test_batches=3, accumulate_grad_batches=2,
                        gradient_clip_val=clip, enable_checkpointing=False, **QUIET)
    trainer.fit(model)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    metrics.update(trainer.test(model, verbose=False)[0])
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(w.dtype == torch.float64 for w in weights.values())
    return {"weights": weights, "metrics": metrics, "lr": lr}


def _corpus(directory: str) -> None:
    """A small corpus where the Transformer demo's WikiText2 looks for its file, so that it
    reads this one instead of downloading."""
    g = torch.Generator().manual_seed(7)
    words = [f"w{i}" for i in range(24)]
    lines = [" ".join(words[int(i)] for i in torch.randint(0, 24, (12,), generator=g))
             for _ in range(40)]
    os.makedirs(os.path.join(directory, "data"), exist_ok=True)
    with open(os.path.join(directory, "data", "wikitext-2.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


class _LocalTransformer(LightningTransformer):
    """The demo, reading the corpus `_corpus` wrote: its own hooks download WikiText2 (and
    need `requests`) even where the file is there."""

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        return DataLoader(WikiText2(download=False))


def _transformer(kind: str, directory: str) -> dict:
    os.chdir(directory)
    torch.manual_seed(0)
    model = _LocalTransformer(vocab_size=WikiText2(download=False).vocab_size)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(kind),
                        precision="64-true", max_steps=3, enable_checkpointing=False, **QUIET)
    trainer.fit(model)
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _trainer_job(directory: str) -> dict:
    runs = {kind: _boring(kind) for kind in ("lightning-ddp", *KINDS)}
    runs["unclipped"] = _boring("lightning-ddp", clip=None)
    for kind in ("lightning-ddp", "zero3"):
        runs["transformer-" + kind] = _transformer(kind, directory)
    return runs


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_trainer_matches_ddp_strategy_in_float64(tmp_path):
    _corpus(str(tmp_path))
    ranks = run_ranks(_trainer_job, world_size=2, args=(str(tmp_path),), timeout=300)
    for runs in ranks:
        base = runs["lightning-ddp"]
        assert _max_difference(base["weights"], runs["unclipped"]["weights"]) > 1e-3, \
            "the clipping value does not clip here: the test would not see clipping fail"
        assert set(base["metrics"]) >= {"train_loss", "val_loss", "test_loss"}
        for kind in KINDS:
            assert _max_difference(base["weights"], runs[kind]["weights"]) < 1e-12, kind
            assert runs[kind]["metrics"].keys() == base["metrics"].keys(), kind
            for name, value in base["metrics"].items():
                assert runs[kind]["metrics"][name] == pytest.approx(value, rel=1e-12), \
                    (kind, name)
            assert runs[kind]["lr"] == base["lr"] == pytest.approx(0.1 * 0.1**2)  # StepLR, 2 epochs
        transformer = runs["transformer-lightning-ddp"]["weights"]
        assert _max_difference(transformer, runs["transformer-zero3"]["weights"]) < 1e-12
    # every rank holds the same model
    assert _max_difference(ranks[0]["zero3"]["weights"], ranks[1]["zero3"]["weights"]) == 0


def _scheduler_warnings() -> dict:
    """What torch's LR scheduler warns about the order of the steps, where the scheduler is built
    before phalanx prepares the optimizer: in `configure_optimizers` (BoringModel's StepLR)
    under the Trainer, before `fabric.setup(model, optimizer, scheduler=...)` and before
    `fabric.setup_optimizers` under Fabric. Each run takes 2 optimizer steps and 2 scheduler
    steps."""
    said = {}
    for kind in ("lightning-ddp", *KINDS):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(kind), max_epochs=2,
                      limit_train_batches=1, limit_val_batches=0, enable_checkpointing=False,
                      **QUIET).fit(BoringModel())
            for order in ("setup", "setup_module first"):
                fabric = L.Fabric(accelerator="cpu", devices=2,
                                  strategy="ddp" if kind == "lightning-ddp" else _strategy(kind))
                fabric.launch()
                model = torch.nn.Linear(4, 2)
                if order == "setup_module first":
                    model = fabric.setup_module(model)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
                if order == "setup":
                    model, optimizer, scheduler = fabric.setup(model, optimizer,
                                                               scheduler=scheduler)
                else:
                    optimizer = fabric.setup_optimizers(optimizer)
                for _ in range(2):
                    fabric.backward(model(torch.randn(3, 4)).sum())
                    optimizer.step()
                    optimizer.zero_grad()
                    scheduler.step()
        said[kind] = [str(w.message) for w in seen
                      if "lr_scheduler" in str(w.message) or "scheduler init" in str(w.message)]
    return said


def test_no_scheduler_warning_when_the_scheduler_comes_before_prepare():
    for said in run_ranks(_scheduler_warnings, world_size=2, timeout=300):
        assert said == {kind: [] for kind in ("lightning-ddp", *KINDS)}, said
