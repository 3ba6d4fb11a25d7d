"""`PhalanxStrategy` under `lightning.Fabric`, and what it refuses.

Fabric's loop (fabric.backward, fabric.no_backward_sync for accumulation,
fabric.clip_gradients, fabric.all_reduce, fabric.save / fabric.load) on 2 CPU ranks with
precision="64-true", under ddp, zero2 and zero3, ends with the weights of the same loop under
Lightning's DDPStrategy to float64 round-off; a run saved and loaded midway ends there too, and
px.load reads Fabric's checkpoint. (Fabric's "64-true" hands the model's outputs back in the
default dtype, float32, so both agree with one plain float64 process to float32's round-off
only: checked too, at that tolerance.) The order Fabric documents for FSDP
(`fabric.setup_module`, the optimizer and its scheduler over the set-up model's parameters, then
`fabric.setup_optimizers`) ends there too.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning", reason="Lightning is not installed: pip install "
                        "-e '.[lightning]' (CI installs it through the test extra)")

from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx.integrations.lightning import PhalanxStrategy  # noqa: E402
from phalanx.testing import RanksFailed, run_ranks  # noqa: E402

STEPS, ACCUMULATE, ROWS, CLIP = 6, 2, 3, 0.05  # ROWS per rank and micro-step


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def _batch(step: int):
    """The whole step's rows: world (2) x ACCUMULATE micro-steps x ROWS."""
    g = torch.Generator().manual_seed(100 + step)
    n = 2 * ACCUMULATE * ROWS
    return torch.randn(n, 8, generator=g).double(), torch.randn(n, 4, generator=g).double()


def _reference() -> dict:
    """One process, plain PyTorch, the whole batch at once."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _setup(kind: str):
    strategy = "ddp" if kind == "lightning-ddp" else PhalanxStrategy(kind)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="64-true")
    fabric.launch()
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                           momentum=0.9))
    return fabric, model, optimizer


def _train(fabric, model, optimizer, steps, scheduler=None) -> list:
    losses = []
    for step in steps:
        x, y = _batch(step)
        for micro in range(ACCUMULATE):
            rows = slice((micro * 2 + fabric.global_rank) * ROWS,
                         (micro * 2 + fabric.global_rank + 1) * ROWS)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = F.mse_loss(model(x[rows]), y[rows]) / ACCUMULATE
                fabric.backward(loss)
            losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return losses


def _fabric_job(directory: str) -> dict:
    out = {}
    for kind in ("lightning-ddp", "ddp", "zero2", "zero3"):
        fabric, model, optimizer = _setup(kind)
        out[kind + "_losses"] = _train(fabric, model, optimizer, range(STEPS))
        out[kind] = {k: v.clone() for k, v in model.state_dict().items()}
    fabric, model, optimizer = _setup("zero3")
    _train(fabric, model, optimizer, range(STEPS // 2))
    out["half"] = {k: v.clone() for k, v in model.state_dict().items()}
    fabric.save(f"{directory}/half", {"model": model, "optimizer": optimizer, "step": 3})
    fabric, model, optimizer = _setup("zero2")
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(f"{directory}/half", state)
    out["loaded_step"], out["remainder"] = state["step"], remainder
    _train(fabric, model, optimizer, range(state["step"], STEPS))
    out["resumed"] = {k: v.clone() for k, v in model.state_dict().items()}
    plain = _model()
    px.load(f"{directory}/half", model=plain)
    out["px_loaded"] = {k: v.clone() for k, v in plain.state_dict().items()}
    return out


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_fabric_matches_ddp_strategy_in_float64(tmp_path):
    reference = _reference()
    ranks = run_ranks(_fabric_job, world_size=2, args=(str(tmp_path),), timeout=300)
    for out in ranks:
        base = out["lightning-ddp"]
        assert _max_difference(base, reference) < 1e-6  # float32 outputs: see the docstring
        for kind in ("ddp", "zero2", "zero3"):
            assert _max_difference(out[kind], base) < 1e-12, kind
            assert out[kind + "_losses"] == pytest.approx(out["lightning-ddp_losses"],
                                                          rel=1e-12)
        assert out["loaded_step"] == 3 and out["remainder"] == {}
        assert _max_difference(out["px_loaded"], out["half"]) == 0
        assert _max_difference(out["resumed"], base) < 1e-12


# -- the order Fabric documents for FSDP ------------------------------------------------------
def _setup_module_first(kind: str):
    """`fabric.setup_module`, then the optimizer over the set-up model's parameters and a
    scheduler over the optimizer, then `fabric.setup_optimizers`."""
    strategy = "ddp" if kind == "lightning-ddp" else PhalanxStrategy(kind)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="64-true")
    fabric.launch()
    model = fabric.setup_module(_model())
    names = [name for name, _ in model.named_parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    optimizer = fabric.setup_optimizers(optimizer)
    assert [name for name, _ in model.named_parameters()] == names
    return fabric, model, optimizer, scheduler


def _setup_module_first_job(directory: str) -> dict:
    out = {}
    for kind in ("lightning-ddp", "ddp", "zero2", "zero3"):
        fabric, model, optimizer, scheduler = _setup_module_first(kind)
        out[kind + "_losses"] = _train(fabric, model, optimizer, range(STEPS), scheduler)
        out[kind] = {k: v.clone() for k, v in model.state_dict().items()}
        out[kind + "_lr"] = optimizer.param_groups[0]["lr"]
    out["names"] = [name for name, _ in model.named_parameters()]
    out["names after setup"] = [name for name, _ in _setup("zero3")[1].named_parameters()]
    fabric.save(f"{directory}/zero3", {"model": model, "optimizer": optimizer})
    plain = _model()
    px.load(f"{directory}/zero3", model=plain)
    out["px_loaded"] = {k: v.clone() for k, v in plain.state_dict().items()}
    # a model used before any optimizer is set up is prepared alone, which zero2 refuses
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=PhalanxStrategy("zero2"),
                      precision="64-true")
    fabric.launch()
    alone = fabric.setup_module(_model())
    try:
        alone(_batch(0)[0])
    except ValueError as exc:
        out["used first"] = str(exc)
    return out


def test_setup_module_then_setup_optimizers_matches_ddp_strategy(tmp_path):
    ranks = run_ranks(_setup_module_first_job, world_size=2, args=(str(tmp_path),), timeout=300)
    for out in ranks:
        base = out["lightning-ddp"]
        assert out["lightning-ddp_lr"] == pytest.approx(0.1 * 0.5**3)  # StepLR: 6 steps
        for kind in ("ddp", "zero2", "zero3"):
            assert _max_difference(out[kind], base) < 1e-12, kind
            assert out[kind + "_losses"] == pytest.approx(out["lightning-ddp_losses"],
                                                          rel=1e-12), kind
            assert out[kind + "_lr"] == out["lightning-ddp_lr"], kind
        assert _max_difference(out["px_loaded"], out["zero3"]) == 0
        # the parameters' names: as fabric.setup gives them (and unchanged by
        # setup_optimizers: asserted in _setup_module_first)
        assert out["names"] == out["names after setup"]
        assert "needs the optimizer" in out["used first"]
        assert "Set up its optimizer before its first use" in out["used first"]


# -- what is refused, and how ---------------------------------------------------------------
class TwoOptimizers(BoringModel):
    """A GAN's shape: two optimizers, stepped by hand (Lightning's manual optimization)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [torch.optim.SGD(self.layer.parameters(), lr=0.1),
                torch.optim.Adam(self.layer.parameters(), lr=0.1)]


def _trainer(strategy, **kwargs):
    return L.Trainer(accelerator="cpu", devices=kwargs.pop("devices", 1), strategy=strategy,
                     max_steps=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, **kwargs)


def _refusals() -> dict:
    """Each refusal's message, in a world of one."""
    said = {}

    def catch(name, fn):
        try:
            fn()
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
            said[name] = str(exc)

    catch("bf16-true", lambda: _trainer(PhalanxStrategy("zero3"), precision="bf16-true"))
    catch("strategy", lambda: PhalanxStrategy("zero4"))
    catch("precision", lambda: PhalanxStrategy("zero3", precision="bf16"))
    catch("two optimizers", lambda: _trainer(PhalanxStrategy("ddp")).fit(TwoOptimizers()))
    catch("clip by value", lambda: _trainer(PhalanxStrategy("zero2"), gradient_clip_val=1.0,
                                            gradient_clip_algorithm="value").fit(BoringModel()))
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=PhalanxStrategy("zero2"))
    fabric.launch()
    catch("no model", lambda: fabric.setup_optimizers(
        torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)))
    model = fabric.setup_module(torch.nn.Linear(4, 2))
    model(torch.randn(1, 4))  # used before an optimizer is set up: prepared alone
    catch("optimizer after use", lambda: fabric.setup_optimizers(
        torch.optim.SGD(model.parameters(), lr=0.1)))
    catch("second model", lambda: fabric.setup_module(torch.nn.Linear(4, 2)))
    catch("filter", lambda: fabric.save("unused", {"model": model},
                                        filter={"model": lambda k, v: True}))
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=PhalanxStrategy("zero2"))
    fabric.launch()
    model = fabric.setup_module(torch.nn.Linear(4, 2))
    catch("setup_optimizers of two", lambda: fabric.setup_optimizers(
        torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)))
    return said


def test_what_is_not_supported_is_refused_by_name():
    said = run_ranks(_refusals, world_size=1, timeout=120)[0]
    assert "'bf16-true'" in said["bf16-true"] and "bf16-mixed" in said["bf16-true"]
    assert "'zero4'" in said["strategy"]
    assert "Trainer(precision=...)" in said["precision"]
    assert "2 optimizers" in said["two optimizers"]
    assert "gradient_clip_algorithm='norm'" in said["clip by value"]
    assert "call fabric.setup_module(model) first" in said["no model"]
    assert "before the model's first use" in said["optimizer after use"]
    assert "a PhalanxStrategy of its own" in said["second model"]
    assert "one optimizer with several param groups" in said["setup_optimizers of two"]
    assert "filter=" in said["filter"]


def _too_few_devices():
    _trainer(PhalanxStrategy("ddp"), devices=1).fit(BoringModel())


def test_devices_that_do_not_match_the_launcher_are_named():
    with pytest.raises(RanksFailed, match=r"devices= \(and num_nodes=\) to match the launcher"):
        run_ranks(_too_few_devices, world_size=2, timeout=120)


def test_phalanx_alone_never_imports_lightning():
    code = ("import sys, phalanx, phalanx.integrations; "
            "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') "
            "for m in sys.modules), 'lightning was imported'; "
            "sys.modules['lightning'] = None; import phalanx.integrations.lightning")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert "lightning was imported" not in done.stderr
    assert "pip install 'phalanx[lightning]'" in done.stderr, done.stderr[-2000:]
