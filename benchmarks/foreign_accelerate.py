"""Accelerate's examples/by_feature/checkpointing.py for benchmarks/foreign_scripts.py: how it is
adapted to run on CPU without downloads (foreign_standins.py) and converted (the rows of
docs/getting-started/coming-from.md's Accelerate table, as edits).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from foreign_cases import Case, Edit, Phase

# -- huggingface/accelerate examples/by_feature/checkpointing.py -------------------------------

A = "checkpointing.py"
PX_STATE = ("model=model, optimizer=optimizer, scheduler=lr_scheduler, "
            "sampler=train_dataloader.sampler")
HELPERS = '''import contextlib
import random

import numpy as np

import phalanx as px


@contextlib.contextmanager
def main_process_first():
    if not px.is_main():
        px.barrier()
    yield
    if px.is_main():
        px.barrier()
'''


def _accelerate_state(where: Path, phase: str) -> dict:
    """The weights of the newest step_N checkpoint: Accelerate's model.safetensors, or the full
    weights `phalanx export` writes from px.save's checkpoint. (A resumed run numbers its
    checkpoints from the step it resumed at within the epoch, so run2's last is step_16.)"""
    from safetensors.torch import load_file

    saved = where / ("run1" if phase == "run" else "run2")
    checkpoint = max(saved.glob("step_*"), key=lambda p: int(p.name[5:]))
    if (checkpoint / "model.safetensors").exists():
        return load_file(checkpoint / "model.safetensors")
    out = where / f"{phase}.safetensors"
    subprocess.run([sys.executable, "-m", "phalanx", "export", str(checkpoint), str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    return load_file(out)


ACCELERATE = Case(
    name="accelerate",
    title="Accelerate checkpointing.py",
    source="accelerate",
    folder="examples/by_feature",
    files=(A,),
    script=A,
    standins={"_standins.py": (Path(__file__).parent / "foreign_standins.py").read_text()},
    adapt=(
        Edit(A, "import evaluate\n", "", "no download: _standins.py"),
        Edit(A, "from datasets import load_dataset\n", "", "no download: _standins.py"),
        Edit(A, "from transformers import AutoModelForSequenceClassification, AutoTokenizer, "
                "get_linear_schedule_with_warmup",
             "from _standins import (AutoModelForSequenceClassification, AutoTokenizer, evaluate,\n"
             "                       get_linear_schedule_with_warmup, load_dataset)",
             "no download: synthetic sentence pairs, a small classifier, accuracy/F1"),
        Edit(A, 'tokenized_datasets["train"], shuffle=True,',
             'tokenized_datasets["train"], shuffle=False,',
             "a shuffled epoch's order is Accelerate's own and phalanx's another: in the "
             "dataset's order both runs see the same global batches"),
        Edit(A, "    set_seed(seed)\n",
             "    torch.set_default_dtype(torch.float64)\n    set_seed(seed)\n",
             "float64"),
        Edit(A, "num_warmup_steps=100,", "num_warmup_steps=10,",
             "48 scheduler steps in all: the warm-up ends, and the decay shows"),
        Edit(A, '"lr": 2e-5,', '"lr": 3e-3,', "a learning rate for the small classifier"),
    ),
    convert=(
        Edit(A, "from accelerate import Accelerator, DataLoaderConfiguration, DistributedType\n"
                "from accelerate.utils import set_seed\n", HELPERS,
             "rows: Accelerator(), with accelerator.main_process_first():, set_seed(seed)"),
        Edit(A, "def get_dataloaders(accelerator: Accelerator, batch_size: int = 16):",
             "def get_dataloaders(mixed_precision: str, batch_size: int = 16):",
             "row: accelerator.mixed_precision"),
        Edit(A, "    with accelerator.main_process_first():", "    with main_process_first():",
             "row: with accelerator.main_process_first():"),
        Edit(A, "accelerator.distributed_type == DistributedType.XLA", "False",
             "row: accelerator.distributed_type"),
        Edit(A, "accelerator.mixed_precision", "mixed_precision",
             "row: accelerator.mixed_precision", count=2),
        Edit(A, "    dataloader_config = DataLoaderConfiguration(use_stateful_dataloader="
                "args.use_stateful_dataloader)\n"
                "    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, "
                "dataloader_config=dataloader_config)",
             '    px.init()\n    mixed_precision = args.mixed_precision or "no"',
             "row: Accelerator(mixed_precision=...)"),
        Edit(A, "    set_seed(seed)\n",
             "    random.seed(seed)\n    np.random.seed(seed)\n    torch.manual_seed(seed)\n",
             "row: set_seed(seed)"),
        Edit(A, "get_dataloaders(accelerator, batch_size)",
             "get_dataloaders(mixed_precision, batch_size)", "row: accelerator.mixed_precision"),
        Edit(A, " and accelerator.distributed_type != DistributedType.XLA", "",
             "row: accelerator.distributed_type"),
        Edit(A, "model = model.to(accelerator.device)", "model = model.to(px.device())",
             "row: accelerator.device"),
        Edit(A, "    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = "
                "accelerator.prepare(\n        model, optimizer, train_dataloader, "
                "eval_dataloader, lr_scheduler\n    )\n",
             '    model, optimizer = px.prepare(model, optimizer, strategy="{strategy}",\n'
             '                                  precision="fp32" if mixed_precision == "no" '
             "else mixed_precision)\n"
             "    train_dataloader = px.data_loader(train_dataloader.dataset, "
             "train_dataloader.batch_size,\n"
             "                                      shuffle=False, "
             "collate_fn=train_dataloader.collate_fn)\n"
             "    eval_dataloader = px.data_loader(eval_dataloader.dataset, "
             "eval_dataloader.batch_size,\n"
             "                                     shuffle=False, "
             "collate_fn=eval_dataloader.collate_fn)\n",
             "row: accelerator.prepare(model, optimizer, loaders, scheduler)"),
        Edit(A, '            accelerator.print(f"Resumed from checkpoint: '
                '{args.resume_from_checkpoint}")',
             '            if px.local_rank() == 0:\n'
             '                print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")',
             "row: accelerator.print"),
        Edit(A, "accelerator.load_state(args.resume_from_checkpoint)",
             f"px.load(args.resume_from_checkpoint, {PX_STATE})", "row: load_state"),
        Edit(A, "accelerator.skip_first_batches(train_dataloader, resume_step)",
             "train_dataloader", "row: skip_first_batches"),
        Edit(A, "batch.to(accelerator.device)", "batch.to(px.device())",
             "row: accelerator.device", count=2),
        Edit(A, "accelerator.backward(loss)", "loss.backward()", "row: accelerator.backward"),
        Edit(A, "                lr_scheduler.step()\n",
             "                for _ in range(px.world_size()):\n"
             "                    lr_scheduler.step()\n",
             "row: the prepared scheduler's step()", key="scheduler"),
        Edit(A, "                    accelerator.save_state(output_dir)\n        model.eval()",
             f"                    px.save(output_dir, {PX_STATE})\n        model.eval()",
             "row: save_state"),
        Edit(A, 'accelerator.gather_for_metrics((predictions, batch["labels"]))',
             'px.gather_for_metrics((predictions, batch["labels"]), eval_dataloader)',
             "row: gather_for_metrics"),
        Edit(A, '        accelerator.print(f"epoch {epoch}:", eval_metric)',
             '        if px.local_rank() == 0:\n            print(f"epoch {epoch}:", eval_metric)',
             "row: accelerator.print"),
        Edit(A, "            accelerator.save_state(output_dir)\n    accelerator.end_training()",
             f"            px.save(output_dir, {PX_STATE})\n    px.shutdown()",
             "rows: save_state, end_training"),
    ),
    phases=(Phase("run", ("--cpu", "--checkpointing_steps", "4", "--output_dir", "run1")),
            Phase("resume", ("--cpu", "--checkpointing_steps", "4", "--output_dir", "run2",
                             "--resume_from_checkpoint", "run1/step_12"))),
    variants=(("ddp", "ddp", ()), ("zero3", "zero3", ()),
              ("ddp, scheduler.step() once", "ddp", ("scheduler",))),
    final_state=_accelerate_state,
    metric=re.compile(r"^epoch (\d+): \{'accuracy': ([\d.e-]+), 'f1': ([\d.e-]+), "
                      r"'count': (\d+)\}"),
)
