"""phalanx inside Ray Train's `TorchTrainer`: Ray starts the workers and makes the process group,
`px.init()` adopts it, and zero2 and zero3 on 2 CPU workers end where one process on the whole
batch ends, in float64. A worker that raises ends `trainer.fit()` with Ray's error naming that
worker's exception (docs/guides/launching.md#ray-train).

Ray is an optional extra (`pip install -e '.[ray]'`, about 500 MB); without it this file is
skipped, and CI does not install it.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (about "
                          "500 MB; CI does not install it)")
pytest.importorskip("ray.train.torch", reason="Ray Train is not installed: pip install -e "
                    "'.[ray]'")

from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

STEPS = 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _batch(step: int):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(8, 6, generator=g).double(), torch.randn(8, 3, generator=g).double()


def _reference() -> dict:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _train_loop(config):
    """What runs on each Ray worker: the ordinary phalanx loop."""
    import phalanx as px

    px.init(timeout=60)
    results = {"world": px.world_size()}
    for strategy in ("zero2", "zero3"):
        model = _model()
        model, optimizer = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                             momentum=0.9), strategy=strategy)
        for step in range(STEPS):
            x, y = _batch(step)
            rows = slice(4 * px.rank(), 4 * px.rank() + 4)
            if config.get("fail") and px.rank() == 1 and step == 2:
                raise RuntimeError("worker 1 fails on purpose")
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
            optimizer.zero_grad()
        results[strategy] = {k: v.tolist() for k, v in model.state_dict().items()}
    with open(f"{config['out']}.rank{px.rank()}.json", "w") as f:
        json.dump(results, f)


def _driver(directory: str) -> str | None:
    """The Ray driver, in a process of its own (run_ranks bounds its time): a local Ray
    instance, a TorchTrainer run, then one that fails; returns the second one's error."""
    import os

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):  # run_ranks' own: Ray sets its workers' variables itself
        os.environ.pop(name, None)
    # the workers cannot import this test module: its functions travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # 4 logical CPUs on 2 cores: the two workers and Ray Train's own controller
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        _trainer(directory, "ok").fit()
        try:
            _trainer(directory, "fail", fail=True).fit()
        except Exception as exc:  # noqa: BLE001 - what Ray raises is what the test reads
            return f"{type(exc).__name__}: {exc}"
        return None
    finally:
        ray.shutdown()


def _trainer(directory: str, name: str, **config):
    return TorchTrainer(_train_loop, train_loop_config={"out": f"{directory}/{name}", **config},
                        scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                     resources_per_worker={"CPU": 1}),
                        run_config=RunConfig(storage_path=f"{directory}/ray", name=name))


@pytest.mark.slow  # Ray starts a local cluster: about 40 s
def test_torchtrainer_runs_zero2_and_zero3(tmp_path):
    from phalanx.testing import run_ranks

    error = run_ranks(_driver, world_size=1, args=(str(tmp_path),), timeout=400)[0]
    # the failing run: Ray's error names the worker's exception
    assert error is not None and "worker 1 fails on purpose" in error, error
    reference = _reference()
    for rank in range(2):
        results = json.loads((tmp_path / f"ok.rank{rank}.json").read_text())
        assert results["world"] == 2
        for strategy in ("zero2", "zero3"):
            for name, value in reference.items():
                got = torch.tensor(results[strategy][name], dtype=torch.float64)
                assert float((got - value).abs().max()) < 1e-12, (rank, strategy, name)

