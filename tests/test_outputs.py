"""Prepared models return what the user's model returns: tuples, dicts, output objects."""

from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch

import phalanx as px
from phalanx._tree import map_tensors
from phalanx.testing import run_ranks


@dataclass
class Output(OrderedDict):
    """Shaped like Hugging Face's ModelOutput: a dataclass that is also an ordered dict."""

    logits: torch.Tensor = None
    hidden: torch.Tensor = None

    def __post_init__(self):
        for k in ("logits", "hidden"):
            self[k] = getattr(self, k)


class WithOutputObject(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.vocab_size = 3  # an attribute users reach through the prepared model

    def forward(self, x):
        h = self.lin(x)
        return Output(logits=h, hidden=(h, {"raw": x}))


@pytest.mark.one_process
def test_map_tensors_keeps_structure_and_types():
    out = Output(logits=torch.ones(2), hidden=(torch.zeros(1), {"raw": torch.ones(3)}))
    mapped = map_tensors(lambda t: t + 1, out)
    assert type(mapped) is Output
    assert torch.equal(mapped.logits, torch.full((2,), 2.0))
    assert torch.equal(mapped["hidden"][1]["raw"], torch.full((3,), 2.0))


def _train_with_output_object(precision):
    torch.manual_seed(0)
    model = WithOutputObject()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt, strategy="ddp", precision=precision)
    x = torch.randn(2, 4)
    out = model(x)
    out.logits.sum().backward()
    opt.step()
    return type(out).__name__, out.logits.dtype, model.vocab_size


def test_output_objects_pass_through_under_every_precision():
    for precision in ("fp32", "bf16"):
        for name, dtype, vocab in run_ranks(_train_with_output_object, 2, args=(precision,),
                                            timeout=60):
            assert (name, dtype, vocab) == ("Output", torch.float32, 3)
