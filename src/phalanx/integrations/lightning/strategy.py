"""`PhalanxStrategy`: phalanx as a strategy of `lightning.Trainer` and `lightning.Fabric`.

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PhalanxStrategy("zero3"))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=PhalanxStrategy("zero3"))

Lightning has two strategy APIs, one per front end, checked with `isinstance` against two
different base classes. One object serves either: `PhalanxStrategy` derives from both, and
the front end that takes it says which it is, when its connector hands it the precision
plugin (the Trainer sets `precision_plugin`, Fabric sets `precision`). The few methods the
two APIs name alike but call differently (backward, optimizer_step, checkpoints, the
launcher, tensor_init_context) go to that front end's version.

What the strategy does, in Lightning's order:
- launching: Lightning's own launcher (`python train.py` with `devices=N` starts the other
  N-1 processes) or any that sets the torchrun variables (`phalanx run`, torchrun, SLURM,
  a PyTorchJob), as Lightning's cluster environments detect them;
- `setup_environment`: writes Lightning's view of the process (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT) where the launcher left it out, then `px.init()`;
- model and optimizer: `px.prepare(module, optimizer, strategy=..., precision=...)`, with
  the precision from Lightning's (precision.py) and `Trainer(sync_batchnorm=True)` as
  phalanx's `sync_batchnorm`; the Trainer's own loops, hooks, schedulers and logging run
  unchanged around the prepared model; Fabric's `setup_module` then `setup_optimizers`
  prepares at the second (pending.py);
- accumulation (`accumulate_grad_batches`, `fabric.no_backward_sync`): `px.no_sync`;
  clipping: `px.clip_grad_norm_`;
- checkpoints: `px.save` / `px.load` (checkpoints.py);
- the collectives Lightning asks for (`self.log(..., sync_dist=True)`, `all_gather`,
  broadcasts of its decisions): torch.distributed on the job's group, as under DDPStrategy.
The data stays Lightning's: it puts torch's DistributedSampler under each loader, as it does
for DDPStrategy, from `distributed_sampler_kwargs`.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from lightning.fabric.strategies import (
    ParallelStrategy as FabricParallel,
    Strategy as FabricStrategy,
)
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as FabricLauncher,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import (
    ParallelStrategy as TrainerParallel,
    Strategy as TrainerStrategy,
)
from lightning.pytorch.strategies.launchers import (
    _SubprocessScriptLauncher as TrainerLauncher,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import (
    rank_zero_only as trainer_rank_zero_only,
)
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

import phalanx as px

from ...spec.strategies import strategy_name
from . import checkpoints
from .collectives import Collectives, broadcast_module
from .optimizer import FabricOptimizer
from .pending import PendingModule, prepared_module
from .precision import fabric_plugin, phalanx_precision, trainer_plugin
from .registry import register_names

__all__ = ["PhalanxStrategy"]

_TRAINER, _FABRIC = "Trainer", "Fabric"


class PhalanxStrategy(Collectives, TrainerParallel, FabricParallel):
    """phalanx's data parallelism as a Lightning strategy, for `lightning.Trainer(strategy=...)`
    and `lightning.Fabric(strategy=...)`.

    strategy: "ddp", "zero1", "zero2", "zero3" (alias "fsdp"), as in `px.prepare`.
    process_group_backend: "gloo", "nccl"... (default: NCCL on GPUs, gloo on CPUs).
    timeout: seconds (or a timedelta) any collective may wait, as `px.init(timeout=)`.
    cluster_environment: one of Lightning's, when its detection should be overridden.
    **prepare_options: `px.prepare`'s other options (bucket_mb, comm_dtype, blocks,
        sync_batchnorm, ...). The precision comes from `Trainer(precision=...)` or
        `Fabric(precision=...)`: "32-true", "64-true", "bf16-mixed" or "16-mixed".

    One model and one optimizer: a LightningModule whose `configure_optimizers` returns
    several, or a Fabric state with several, is refused with its reason.

    By name (registry.py), after `import phalanx.integrations.lightning`:
    `Trainer(strategy="phalanx")` is PhalanxStrategy("ddp"), "phalanx_zero3" PhalanxStrategy(
    "zero3"), and so on for every strategy.
    """

    strategy_name = "phalanx"

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Lightning's hook for a strategy class's names (registry.py)."""
        register_names(strategy_registry, cls)

    def __init__(self, strategy: str = "ddp", *, process_group_backend: str | None = None,
                 timeout: float | datetime.timedelta = 600.0, cluster_environment=None,
                 **prepare_options) -> None:
        if "precision" in prepare_options:
            raise ValueError("PhalanxStrategy takes the precision from Lightning: "
                             "Trainer(precision=...) or Fabric(precision=...)")
        if isinstance(strategy, str):
            strategy_name(strategy, where="PhalanxStrategy strategy")  # raises on a typo
        self._face = None  # _TRAINER or _FABRIC: see the module docstring
        TrainerParallel.__init__(self, cluster_environment=cluster_environment)
        FabricParallel.__init__(self, cluster_environment=cluster_environment)
        self._px_strategy = strategy
        self._px_options = prepare_options
        self._px_backend = process_group_backend
        self._px_timeout = timeout
        self._px_precision = "fp32"
        self._num_nodes = 1
        self._prepared = None  # the model px.prepare returned (one per strategy)
        self._pending = None  # what fabric.setup_module returned (pending.py)
        self._backward_sync_control = _NoSync()

    # -- which front end, and the precision it brings ------------------------------------------
    @property
    def precision_plugin(self):
        return self._precision_plugin if self._precision_plugin is not None \
            else TrainerStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if plugin is not None:  # set by the Trainer's connector
            self._face = _TRAINER
            self._px_precision = phalanx_precision(plugin)
            plugin = trainer_plugin(plugin, lambda: self._prepared)
        self._precision_plugin = plugin

    @property
    def precision(self):
        return self._precision if self._precision is not None \
            else FabricStrategy.precision.fget(self)

    @precision.setter
    def precision(self, plugin) -> None:
        if plugin is not None:  # set by Fabric's connector
            self._face = _FABRIC
            self._px_precision = phalanx_precision(plugin)
            plugin = fabric_plugin(plugin)
        self._precision = plugin

    # -- the processes -------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:  # what the Trainer asks a strategy of its own
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank = self.global_rank
        trainer_rank_zero_only.rank = fabric_rank_zero_only.rank = rank
        utils_rank_zero_only.rank = rank

    _set_world_ranks = set_world_ranks  # the name Fabric's connector calls

    def _configure_launcher(self) -> None:
        launcher = TrainerLauncher if self._face == _TRAINER else FabricLauncher
        self._launcher = launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        self.accelerator.setup_device(self.root_device)
        reset_seed()  # the seed Lightning's seed_everything chose, as DDPStrategy does
        self.set_world_ranks()
        if self.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            # px.init() reads the torchrun variables; Lightning's launcher sets all but RANK
            env = self.cluster_environment
            for name, value in (("MASTER_ADDR", env.main_address),
                                ("MASTER_PORT", env.main_port), ("RANK", self.global_rank),
                                ("WORLD_SIZE", self.world_size),
                                ("LOCAL_RANK", self.local_rank)):
                os.environ.setdefault(name, str(value))
        px.init(backend=self._px_backend, timeout=self._px_timeout, device=str(self.root_device))
        if (px.world_size(), px.rank()) != (self.world_size, self.global_rank):
            raise RuntimeError(
                f"Lightning counts {self.world_size} processes (devices x num_nodes) and "
                f"this one as rank {self.global_rank}, but the job has {px.world_size()} "
                f"and this is rank {px.rank()}: give the {self._face} devices= (and "
                "num_nodes=) to match the launcher (phalanx run -n N: devices=N)")

    # -- the model -----------------------------------------------------------------------------
    def _refuse_a_second_model(self) -> None:
        raise ValueError(
            "this PhalanxStrategy has a model already (prepared, or set up by "
            "fabric.setup_module), and phalanx prepares a model and its optimizer once: give "
            "each Trainer.fit or Fabric.setup of a new model a PhalanxStrategy of its own")

    def _prepare(self, module, optimizer):
        if self._prepared is not None:
            self._refuse_a_second_model()
        sync_bn = self._px_options.get("sync_batchnorm", False) or \
            getattr(self, "_layer_sync", None) is not None
        options = {**self._px_options, "sync_batchnorm": sync_bn}
        self._prepared, _ = px.prepare(module, optimizer, strategy=self._px_strategy,
                                       precision=self._px_precision, **options)
        return self._prepared

    def setup(self, trainer) -> None:
        """The Trainer's setup: phalanx prepares the LightningModule with its optimizer."""
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._prepared is not None and px.unwrap(self._prepared) is self.lightning_module:
            self.model = self._prepared  # after fit: validate, test and predict go on with it
        elif not fitting:
            # evaluation of a model never fitted here: replicated, with rank 0's values (as
            # DDPStrategy does); ckpt_path= loads into it
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            broadcast_module(self.model)
        else:
            if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
                self.precision_plugin.clip_grad_by_value(None, trainer.gradient_clip_val)
            self.model = self.precision_plugin.convert_module(self.model)
            self.setup_optimizers(trainer)
            if len(self.optimizers) > 1:
                raise ValueError(
                    f"configure_optimizers returned {len(self.optimizers)} optimizers; "
                    "PhalanxStrategy prepares a model with one optimizer (px.prepare): use one "
                    "optimizer with several param groups")
            self.model = self._prepare(self.model, self.optimizers[0] if self.optimizers
                                       else None)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def module_to_device(self, module) -> None:
        module.to(self.root_device)

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if len(optimizers) > 1:
            raise ValueError(f"fabric.setup was given {len(optimizers)} optimizers; "
                             "PhalanxStrategy prepares a model with one optimizer (px.prepare)")
        if self._pending is not None:
            self._refuse_a_second_model()
        optimizer = optimizers[0] if optimizers else None
        module = self._prepare(module, optimizer)
        # See [Note: Fabric's optimizer wrapper and zero_grad] in optimizer.py
        return module, [FabricOptimizer(optimizer)] if optimizer is not None else [], scheduler

    def setup_module(self, module):
        """`fabric.setup_module(model)` (and `fabric.setup(model)`): prepared with the optimizer
        that `fabric.setup_optimizers` sets up next. See [Note: Fabric's setup_module, then
        setup_optimizers] in pending.py."""
        if self._prepared is not None or self._pending is not None:
            self._refuse_a_second_model()
        self._pending = PendingModule(module, self._prepare)
        return self._pending

    def setup_optimizer(self, optimizer):
        """`fabric.setup_optimizers(optimizer)`: phalanx prepares the model set up by
        `fabric.setup_module` with it, as `fabric.setup(model, optimizer)` would have."""
        if self._pending is None:
            raise ValueError(
                "fabric.setup_optimizers(optimizer) under PhalanxStrategy prepares the model set "
                "up by fabric.setup_module(model) with that optimizer, and no model was set up "
                "alone: call fabric.setup_module(model) first (or fabric.setup(model, optimizer))")
        self._pending.prepare_with(optimizer)
        # See [Note: Fabric's optimizer wrapper and zero_grad] in optimizer.py
        return FabricOptimizer(optimizer)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """The Trainer's accumulation micro-steps: backward without communication."""
        with px.no_sync(self.model) if self._prepared is not None else contextlib.nullcontext():
            yield

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        norm = px.clip_grad_norm_(prepared_module(module), max_norm, norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               "non-finite, so they cannot be clipped")
        return norm

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        self.precision_plugin.clip_grad_by_value(optimizer, clip_val)

    # -- the methods both APIs name, called differently ----------------------------------------
    def backward(self, *args, **kwargs):
        base = TrainerStrategy if self._face == _TRAINER else FabricStrategy
        return base.backward(self, *args, **kwargs)

    def optimizer_step(self, *args, **kwargs):
        base = TrainerStrategy if self._face == _TRAINER else FabricStrategy
        return base.optimizer_step(self, *args, **kwargs)

    def tensor_init_context(self, empty_init: bool | None = None):
        if self._face == _FABRIC:
            return FabricStrategy.tensor_init_context(self)
        return TrainerStrategy.tensor_init_context(self, empty_init)

    def save_checkpoint(self, *args, **kwargs) -> None:
        """Trainer: (checkpoint, filepath, storage_options); Fabric: (path, state,
        storage_options, filter). A collective, written by px.save (checkpoints.py)."""
        if self._face == _TRAINER:
            checkpoint, path, storage_options = _args(args, kwargs, "checkpoint", "filepath",
                                                      "storage_options")
        else:
            path, state, storage_options, keep = _args(args, kwargs, "path", "state",
                                                       "storage_options", "filter")
            if keep:
                raise ValueError("PhalanxStrategy saves whole states: fabric.save(filter=...) "
                                 "is not supported")
        if storage_options is not None:
            raise TypeError("PhalanxStrategy writes checkpoints with px.save, which takes no "
                            "storage_options")
        path = self.broadcast(os.fspath(path))
        if self._face == _TRAINER:
            checkpoints.save_trainer(checkpoint, path, self._trained_model(), self.optimizers)
        else:
            checkpoints.save_fabric(path, state)

    def load_checkpoint(self, *args, **kwargs) -> dict:
        """Trainer: (checkpoint_path, weights_only); Fabric: (path, state, strict,
        weights_only). A collective, read by px.load (checkpoints.py)."""
        if self._face == _TRAINER:
            path, _ = _args(args, kwargs, "checkpoint_path", "weights_only")
            path = self.broadcast(os.fspath(path))
            module = self.lightning_module
            fitting = module.trainer.state.fn == TrainerFn.FITTING
            return checkpoints.load_trainer(path, self._trained_model(), self.optimizers, fitting,
                                            module.strict_loading, self.checkpoint_io)
        path, state, strict, _ = _args(args, kwargs, "path", "state", "strict", "weights_only",
                                       defaults={"strict": True})
        return checkpoints.load_fabric(self.broadcast(os.fspath(path)), state, strict)

    def _trained_model(self):
        """The model a Trainer's checkpoint holds: the prepared one, also after fit (when
        `self.model` is the LightningModule again, whose zero3 parameters hold no values)."""
        prepared = self._prepared
        if prepared is not None and px.unwrap(prepared) is self.lightning_module:
            return prepared
        return self.model

    def remove_checkpoint(self, filepath) -> None:
        checkpoints.remove(os.fspath(filepath), self.is_global_zero, self.checkpoint_io)

    # What the Trainer would otherwise gather for its dictionary: px.save writes both.
    def lightning_module_state_dict(self) -> dict:
        return {}

    def optimizer_state(self, optimizer) -> dict:
        return {}

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # loaded by load_checkpoint

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # px.load loads into the prepared model

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def teardown(self) -> None:
        """The end of a fit, test or Fabric run. The model stays prepared (its parameters
        live in phalanx's buffers, so it is not moved to the CPU as DDPStrategy moves its
        model), and the process group stays for the next run; px.shutdown() at exit ends it."""
        if self._face == _TRAINER and self.lightning_module is not None:
            self.model = self.lightning_module
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        (self.precision_plugin if self._face == _TRAINER else self.precision).teardown()
        self.accelerator.teardown()


class _NoSync:
    """Fabric's hook for `fabric.no_backward_sync(model)`: `px.no_sync`."""

    def no_backward_sync(self, module, enabled: bool):
        return px.no_sync(prepared_module(module)) if enabled else contextlib.nullcontext()


def _args(args, kwargs, *names, defaults=None) -> list:
    """A method's arguments by name, whether given by position or keyword."""
    given = dict(zip(names, args), **kwargs)
    return [given.get(n, (defaults or {}).get(n)) for n in names]
