"""The memory and time planner: `px.plan(...)` and `phalanx plan`.

Will a model train data-parallel on these devices, with which strategy, and how fast? The
answer is arithmetic over a description of the model (a parameter count, a Hugging Face style
config, or a module built on the meta device): ZeRO's model-state layout (memory.py), the
activation formula of Korthikanti et al. or a traced forward (transformer.py, trace.py), ring
communication volumes and a compute/overlap model (comm.py); for fine-tuning, frozen
parameters and LoRA adapters (finetune.py), offload to host memory (offload.py) and, when
nothing fits, what would (alternatives.py). No process group, no GPU. Its options come in four
frozen groups, `Hardware`, `Workload`, `Training` (px.prepare's options, or a Spec's) and
`Report` (setting.py), which px.plan's keywords build.
"""

from .api import plan
from .layouts import LayoutComparison, compare_layouts
from .report import PlanResult, StrategyPlan
from .setting import Hardware, Report, Training, Workload

__all__ = ["plan", "PlanResult", "StrategyPlan", "compare_layouts", "LayoutComparison",
           "Hardware", "Workload", "Training", "Report"]
