"""Lightning's strategy names for phalanx: `Trainer(strategy="phalanx_zero3")` and
`Fabric(strategy="phalanx_zero2")` after `import phalanx.integrations.lightning`.

Each name gives a `PhalanxStrategy` of its strategy, in both of Lightning's registries; the names
come with the integration's import (Lightning has no entry point for a strategy), never with
`import phalanx` alone; and a fit under a name, on 2 CPU ranks in float64, ends where Lightning's
`strategy="ddp"` ends.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning", reason="Lightning is not installed: pip install "
                        "-e '.[lightning]' (CI installs it through the test extra)")

from lightning.fabric.strategies import STRATEGY_REGISTRY  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from phalanx.integrations.lightning import PhalanxStrategy  # noqa: E402
from phalanx.testing import engine_of, run_ranks  # noqa: E402

NAMES = {"phalanx": "ddp", "phalanx_ddp": "ddp", "phalanx_zero1": "zero1",
         "phalanx_zero2": "zero2", "phalanx_zero3": "zero3", "phalanx_fsdp": "zero3"}
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


@pytest.mark.one_process
@pytest.mark.parametrize("name", sorted(NAMES))
def test_each_name_is_a_phalanx_strategy_for_the_trainer_and_fabric(name):
    assert name in StrategyRegistry and name in STRATEGY_REGISTRY
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=name, **QUIET)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=name)
    for strategy in (trainer.strategy, fabric.strategy):
        assert type(strategy) is PhalanxStrategy
        assert strategy._px_strategy == NAMES[name]
    assert StrategyRegistry.get(name) is not StrategyRegistry.get(name)  # a new one each time
    assert StrategyRegistry[name]["description"].startswith("phalanx")


def test_the_names_come_with_the_integration_not_with_phalanx():
    code = ("from lightning.pytorch.strategies import StrategyRegistry as t; "
            "from lightning.fabric.strategies import STRATEGY_REGISTRY as f; "
            "import phalanx; "
            "assert not [n for n in (*t, *f) if n.startswith('phalanx')], 'registered early'; "
            "import phalanx.integrations.lightning; "
            f"missing = [n for n in {sorted(NAMES)!r} if n not in t or n not in f]; "
            "assert not missing, missing; print('registered')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and "registered" in done.stdout, done.stderr[-2000:]


def _fit(strategy):
    torch.manual_seed(0)
    model = BoringModel()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="64-true",
                        max_epochs=2, limit_train_batches=4, limit_val_batches=2,
                        accumulate_grad_batches=2, enable_checkpointing=False, **QUIET)
    trainer.fit(model)
    engine = engine_of(getattr(trainer.strategy, "_prepared", None))
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            engine.reshards if engine is not None else None)


def _fabric(strategy) -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="64-true")
    fabric.launch()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4)).double()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                           momentum=0.9))
    g = torch.Generator().manual_seed(fabric.global_rank)
    for _ in range(4):
        x, y = torch.randn(6, 8, generator=g).double(), torch.randn(6, 4, generator=g).double()
        fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _by_name() -> dict:
    out = {"trainer-ddp": _fit("ddp"), "trainer-phalanx_zero3": _fit("phalanx_zero3")}
    out["fabric-ddp"], out["fabric-phalanx_zero2"] = _fabric("ddp"), _fabric("phalanx_zero2")
    return out


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_a_name_trains_as_lightning_ddp_does_in_float64():
    for out in run_ranks(_by_name, world_size=2, timeout=240):
        (ddp, _), (zero3, sharded) = out["trainer-ddp"], out["trainer-phalanx_zero3"]
        assert sharded is True  # "phalanx_zero3" shards the parameters
        assert _max_difference(ddp, zero3) < 1e-12
        assert _max_difference(out["fabric-ddp"], out["fabric-phalanx_zero2"]) < 1e-12
