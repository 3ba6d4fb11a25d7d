"""The Hugging Face recipe of docs/guides/integrations/huggingface.md, run as the page writes
it: on 2 CPU ranks and on one process with the whole batch (batch_size 8 instead of 4: the
same samples in each step, see px.data_loader), both in float64 (the default dtype set before
the model is built); the exported weights agree to float64 round-off.

Skipped where `transformers` is not installed (CI does not install it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (CI does not install "
                    "it): pip install transformers")

from phalanx.testing import run_ranks

PAGE = Path(__file__).resolve().parent.parent / "docs/guides/integrations/huggingface.md"


def _recipe() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    (recipe,) = [b for b in blocks if "px.export" in b]
    return recipe


def _run(code: str, directory: str):
    os.makedirs(directory, exist_ok=True)
    os.chdir(directory)
    torch.set_default_dtype(torch.float64)
    exec(compile(code, "huggingface.md", "exec"), {"__name__": "__main__"})


def _exported(directory: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def test_recipe_on_two_ranks_equals_one_process(tmp_path):
    recipe = _recipe()
    assert "batch_size=4" in recipe and "range(2)" in recipe
    run_ranks(_run, world_size=2, args=(recipe, str(tmp_path / "two")), timeout=300)
    run_ranks(_run, world_size=1, args=(recipe.replace("batch_size=4", "batch_size=8"),
                                        str(tmp_path / "one")), timeout=300)
    run_ranks(_run, world_size=1, args=(recipe.replace("range(2)", "range(0)"),
                                        str(tmp_path / "untrained")), timeout=300)
    two, one = _exported(str(tmp_path / "two")), _exported(str(tmp_path / "one"))
    untrained = _exported(str(tmp_path / "untrained"))
    assert max(float((untrained[k] - one[k]).abs().max()) for k in one) > 1e-3  # it trained
    assert two.keys() == one.keys() and len(two) > 10
    assert all(t.dtype == torch.float64 for t in two.values())
    assert max(float((two[k] - one[k]).abs().max()) for k in two) < 1e-10
