"""The scripts of benchmarks/foreign_scripts.py from pytorch/examples: where they are, how each is
adapted to run on CPU, and how each is converted (the rows of
docs/getting-started/coming-from.md, as edits). Accelerate's is in foreign_accelerate.py.

An edit's `why` is the reason for an adaptation, or, for a conversion, the row of coming-from.md
it applies ("row: ..."). Adaptations are the same for the original and the converted copy.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str
    why: str
    key: str = ""  # names an edit a variant leaves out
    count: int = 1  # the occurrences of `old` (all are replaced)


@dataclass(frozen=True)
class Phase:
    name: str
    args: tuple


@dataclass
class Case:
    name: str
    title: str
    source: str  # "examples" or "accelerate": which checkout
    folder: str
    files: tuple
    script: str
    adapt: tuple
    convert: tuple
    phases: tuple
    variants: tuple  # (label, strategy, keys of conversion edits left out)
    final_state: Callable[[Path, str], dict]  # (run directory, phase) -> tensors
    metric: re.Pattern
    standins: dict = field(default_factory=dict)


def _flat(prefix: str, value, out: dict) -> dict:
    """Every tensor in nested dicts and lists, under dotted names; numbers as 0-d tensors."""
    if isinstance(value, torch.Tensor):
        out[prefix] = value.detach().cpu()
    elif isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flat(f"{prefix}.{i}", v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = torch.tensor(float(value))
    return out


# -- pytorch/examples distributed/ddp-tutorial-series: multigpu_torchrun.py --------------------

T = "multigpu_torchrun.py"
TUTORIAL = Case(
    name="tutorial",
    title="DDP tutorial (multigpu_torchrun.py)",
    source="examples",
    folder="distributed/ddp-tutorial-series",
    files=(T, "datautils.py"),
    script=T,
    adapt=(
        Edit(T, '    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n'
                '    init_process_group(backend="nccl")',
             '    init_process_group(backend="gloo")', "CPU: gloo, no GPU to select"),
        Edit(T, "self.model = model.to(self.gpu_id)", 'self.model = model.to("cpu")', "CPU"),
        Edit(T, 'loc = f"cuda:{self.gpu_id}"', 'loc = "cpu"', "CPU"),
        Edit(T, "source = source.to(self.gpu_id)", 'source = source.to("cpu")', "CPU"),
        Edit(T, "targets = targets.to(self.gpu_id)", 'targets = targets.to("cpu")', "CPU"),
        Edit(T, "DDP(self.model, device_ids=[self.gpu_id])", "DDP(self.model)",
             "CPU: DDP takes no device_ids"),
        Edit(T, "loss = F.cross_entropy(output, targets)", "loss = F.mse_loss(output, targets)",
             "the original's loss is a cross-entropy over one output, identically zero: "
             "nothing would train"),
        Edit(T, "    ddp_setup()\n",
             "    ddp_setup()\n    torch.manual_seed(0)\n"
             "    torch.set_default_dtype(torch.float64)\n",
             "each rank draws its data unseeded; seeded, and float64"),
    ),
    convert=(
        Edit(T, "from torch.nn.parallel import DistributedDataParallel as DDP",
             "import phalanx as px", "row: DDP(model, device_ids=...)"),
        Edit(T, "self.model = DDP(self.model)",
             'self.model, self.optimizer = px.prepare(self.model, self.optimizer, '
             'strategy="{strategy}")', "row: DDP(model, device_ids=...)"),
    ),
    phases=(Phase("run", ("2", "1")), Phase("resume", ("4", "1"))),
    variants=(("ddp", "ddp", ()), ("zero3", "zero3", ())),
    final_state=lambda where, phase: _flat(
        "", torch.load(where / "snapshot.pt", weights_only=True)["MODEL_STATE"], {}),
    metric=re.compile(r"\[GPU0\] Epoch (\d+) \| Batchsize: (\d+) \| Steps: (\d+)"),
)





# -- pytorch/examples distributed/minGPT-ddp: the minGPT trainer ------------------------------

M, TR = "main.py", "trainer.py"
TINY_GPT = '''"""A tiny configuration in place of gpt2_train_cfg.yaml (read there through hydra).

argv: max_epochs, then "amp" (fp16 autocast + GradScaler, float32, as the yaml has it) or
"fp64" (no AMP, float64: CPU autocast computes layer_norm in float32, which float64 weights
refuse, so AMP runs in float32).
"""
import sys

import torch

USE_AMP = sys.argv[2] == "amp"
DTYPE = torch.float32 if USE_AMP else torch.float64
CONFIG = {
    "data_config": {"path": "data/input.txt", "block_size": 32, "train_split": 0.9,
                    "truncate": 0.002},
    "gpt_config": {"n_layer": 2, "n_head": 2, "n_embd": 32,
                   "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0},
    "trainer_config": {"max_epochs": int(sys.argv[1]), "batch_size": 16,
                       "data_loader_workers": 0, "grad_norm_clip": 1.0,
                       "snapshot_path": "gpt_snapshot.pt", "save_every": 1, "use_amp": USE_AMP},
    "optimizer_config": {"weight_decay": 0.1, "learning_rate": 0.0003},
}
'''
def _mingpt(amp: bool) -> Case:
    return Case(
        name="mingpt-amp" if amp else "mingpt",
        title="minGPT trainer, " + ("fp16 autocast + GradScaler, float32" if amp else "float64"),
        source="examples",
        folder="distributed/minGPT-ddp/mingpt",
        files=(M, TR, "model.py", "char_dataset.py", "data/input.txt"),
        script=M,
        standins={"tiny_config.py": TINY_GPT},
        adapt=(
            Edit(M, "from omegaconf import DictConfig\nimport hydra\n",
                 "from tiny_config import CONFIG, DTYPE\n",
                 "no hydra: the configuration is tiny_config.py (the yaml's keys; 2 layers of "
                 "width 32, blocks of 32 characters, 0.2% of the text, no dropout)"),
            Edit(M, '    device: torch.device = torch.device(f"{acc}:{rank}")',
                 '    device: torch.device = torch.device("cpu")', "CPU"),
            Edit(M, "    torch.accelerator.set_device_index(rank)\n", "", "CPU"),
            Edit(M, '@hydra.main(version_base=None, config_path=".", '
                    'config_name="gpt2_train_cfg")\n'
                    'def main(cfg: DictConfig):\n    ddp_setup()\n',
                 "def main(cfg):\n    ddp_setup()\n    torch.manual_seed(0)\n"
                 "    torch.set_default_dtype(DTYPE)\n",
                 "no hydra; random_split and the model are drawn unseeded per rank: seeded, and "
                 "float64 where AMP is off"),
            Edit(M, "    if not verify_min_gpu_count(min_gpus=_min_gpu_count):\n",
                 "    if False:\n", "CPU"),
            Edit(M, "    main()", "    main(CONFIG)", "no hydra"),
            Edit(M, "    model = GPT(gpt_cfg)\n", "    model = GPT(gpt_cfg).to(DTYPE)\n",
                 "the attention and embeddings are built in float32 whatever the default "
                 "dtype"),
            Edit(TR, "import boto3\n", "", "no S3 upload here"),
            Edit(TR, '        self.acc = torch.accelerator.current_accelerator()\n'
                     '        self.device: torch.device = '
                     'torch.device(f"{self.acc}:{self.local_rank}")',
                 '        self.device: torch.device = torch.device("cpu")', "CPU"),
            Edit(TR, "self.model = model.to(self.local_rank)", 'self.model = model.to("cpu")',
                 "CPU"),
            Edit(TR, "source = source.to(self.local_rank)", 'source = source.to("cpu")', "CPU"),
            Edit(TR, "targets = targets.to(self.local_rank)", 'targets = targets.to("cpu")', "CPU"),
            Edit(TR, "DDP(self.model, device_ids=[self.local_rank])", "DDP(self.model)",
                 "CPU: DDP takes no device_ids"),
        ),
        convert=(
            Edit(TR, "from torch.nn.parallel import DistributedDataParallel as DDP",
                 "import phalanx as px", "row: DDP(model, device_ids=...)"),
            Edit(TR, "self.model = DDP(self.model)",
                 'self.model, self.optimizer = px.prepare(self.model, self.optimizer, '
                 'strategy="{strategy}")', "row: DDP(model, device_ids=...)"),
        ),
        phases=(Phase("run", ("2", "amp" if amp else "fp64")),
                Phase("resume", ("4", "amp" if amp else "fp64"))),
        variants=(("ddp", "ddp", ()), ("zero2", "zero2", ()), ("zero3", "zero3", ())),
        final_state=lambda where, phase: _flat(
            "", torch.load(where / "gpt_snapshot.pt", weights_only=True), {}),
        metric=re.compile(r"\[RANK0\] Epoch (\d+) \| Iter (\d+) \| \w+ Loss ([\d.]+)"),
    )



# -- pytorch/examples distributed/FSDP2: example.py with its DCP checkpointer ------------------

E = "example.py"


def _fsdp2_state(where: Path, phase: str) -> dict:
    """The newest checkpoint the script wrote: its full model and optimizer state dicts."""
    root = where / "checkpoints" / "dcp_api"
    newest = max((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    model = torch.load(newest / "model_state_dict.pt", weights_only=True)
    optim = torch.load(newest / "optim_state_dict.pt", weights_only=True)
    return _flat("optim", optim, _flat("model", model, {}))


FSDP2 = Case(
    name="fsdp2",
    title="FSDP2 example, DCP state dicts (--dcp-api)",
    source="examples",
    folder="distributed/FSDP2",
    files=(E, "checkpoint.py", "model.py", "utils.py"),
    script=E,
    adapt=(
        Edit(E, "    if not verify_min_gpu_count(min_gpus=_min_gpu_count):\n", "    if False:\n",
             "CPU"),
        Edit(E, "init_process_group(backend=backend, device_id=device)",
             "init_process_group(backend=backend)",
             "CPU: device_id must be an accelerator"),
        Edit(E, "    torch.manual_seed(0)\n",
             "    torch.manual_seed(0)\n    torch.set_default_dtype(torch.float64)\n", "float64"),
        Edit(E, '    with torch.device("meta"):\n        model = Transformer(model_args)',
             "    model = Transformer(model_args)",
             "the model is built seeded on the CPU: the original's model.reset_parameters() "
             "initialises only the root's own layers (embeddings, norm, output), and leaves the "
             "blocks with what to_empty allocated, which differs from run to run"),
        Edit(E, "        model.to_empty(device=device)\n        model.reset_parameters()",
             "        pass", "(the same)"),
        Edit("utils.py", "assert param.dtype == torch.float32",
             "assert param.dtype == torch.float64", "float64"),
    ),
    convert=(
        Edit(E, "from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy",
             "import phalanx as px", "row: fully_shard(block) ... fully_shard(model)"),
        Edit(E, '    fsdp_kwargs = {}\n    if args.mixed_precision:\n'
                '        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(\n'
                '            param_dtype=torch.bfloat16,\n'
                '            reduce_dtype=torch.float32,\n        )\n'
                '    for layer in model.layers:\n        fully_shard(layer, **fsdp_kwargs)\n'
                '    fully_shard(model, **fsdp_kwargs)\n',
             '    precision = "bf16" if args.mixed_precision else "fp32"\n',
             "rows: fully_shard(...), MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...)"),
        Edit(E, "    inspect_model(model)\n", "",
             "row: isinstance(m, FSDPModule), DTensor placements (FSDP's own types)"),
        Edit(E, "    if args.explicit_prefetching:\n"
                "        set_modules_to_forward_prefetch(model, num_to_forward_prefetch=2)\n"
                "        set_modules_to_backward_prefetch(model, num_to_backward_prefetch=2)\n",
             "", "row: set_modules_to_forward_prefetch / _backward_prefetch"),
        Edit(E, "    if args.mixed_precision:\n        inspect_mixed_precision(model)\n", "",
             "row: isinstance(m, FSDPModule), ... (inspect_mixed_precision unshards by hand)"),
        Edit(E, "    optim = torch.optim.Adam(model.parameters(), lr=1e-2)\n",
             "    optim = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
             '    model, optim = px.prepare(model, optim, strategy="{strategy}", '
             "precision=precision,\n"
             "                              prefetch=2 if args.explicit_prefetching else None)\n",
             "row: fully_shard(...): px.prepare once the optimizer exists"),
        Edit(E, "        if args.explicit_prefetching:\n            model.unshard()\n", "",
             "row: model.unshard() / reshard()"),
    ),
    phases=(Phase("run", ("--dcp-api",)), Phase("resume", ("--dcp-api",))),
    variants=(("zero3", "zero3", ()),),
    final_state=_fsdp2_state,
    metric=re.compile(r"(?!)"),  # it prints no metric
)


CASES = [TUTORIAL, _mingpt(False), _mingpt(True), FSDP2]
