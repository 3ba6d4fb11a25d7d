"""The model, data and training loop the checkpoint tests share (test_checkpoint.py,
test_checkpoint_files.py, test_checkpoint_writing.py), in float64 unless a test says otherwise.

`train_steps` trains on this rank's rows of the same global batches a single process would
take whole; `state_of` reads back what a comparison needs, as one process has it.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import engine_of

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4 ranks
K = 3


class TiedLM(nn.Module):
    """Tied input and output embeddings, a frozen layer and a buffer: every kind of tensor."""

    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.inp = nn.Linear(d, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(16, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("temperature", torch.tensor(1.5))

    def forward(self, tokens):
        h = torch.tanh(self.inp(self.embed(tokens)))
        h = torch.tanh(self.frozen(h))
        return self.head(torch.tanh(self.out(h))) / self.temperature


def make_model(seed):
    torch.manual_seed(seed)
    return TiedLM().double()


def make_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=g)


def train_steps(model, opt, steps, first_step, world, rank):
    rows = GLOBAL_BATCH // world
    for step in range(first_step, first_step + steps):
        tokens = make_batch(step)[rank * rows:(rank + 1) * rows]
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def state_of(model, opt):
    """Parameters and buffers by name, and the optimizer state by parameter name, as one
    process has them (float64). (zero3 keeps no whole parameter: the prepared model's
    state_dict() gathers them.)"""
    zero3 = getattr(engine_of(model), "reshards", False)  # engine_of: None if not prepared
    source = model if zero3 else px.unwrap(model)
    params = {k: v.detach().double().clone() for k, v in source.state_dict().items()}
    names = [n for n, _ in px.unwrap(model).named_parameters()]  # the optimizer's order
    sd = px.optimizer_state_dict(opt)
    optim = {}
    for index, s in sd["state"].items():
        optim[names[int(index)]] = {k: v.double().clone() for k, v in s.items()
                                    if torch.is_tensor(v)}
    return params, optim
