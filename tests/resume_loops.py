"""The training loops users write around a resume, shared by test_checkpoint_resume.py: the
docs' epoch loop (`loader.sampler.set_epoch(epoch); for x, y in loader: ...`) with a dropout
layer, and the loop of Accelerate's `examples/by_feature/checkpointing.py`, which computes
the epoch to resume in from `len(train_dataloader)`.

Everything is float64 on 2 ranks: 40 samples, 2 per rank, so an epoch is 10 steps.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from checkpoint_runs import state_of

import phalanx as px

SAMPLES, PER_RANK, EPOCHS = 40, 2, 2


def dataset():
    g = torch.Generator().manual_seed(11)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64),
                                          torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64))


class Augmented(torch.utils.data.Dataset):
    """Random augmentation as a dataset's transform draws it, from each of the three generators
    a loader worker holds: torch's, Python's `random` and NumPy's."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        import random

        import numpy as np
        x, y = self.samples[i]
        noise = 0.1 * torch.randn(x.shape, dtype=x.dtype) + 0.01 * random.random()
        return x + noise + 0.01 * float(np.random.rand()), y


def build(strategy, dropout, seed=0):
    """A model, its optimizer and loader, prepared; `seed` other than 0: other initial values
    (a resumed run whose values only the load can set)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 16),
                          nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = px.prepare(model, opt, strategy=strategy)
    return model, opt, px.data_loader(dataset(), PER_RANK, seed=5)


def step_on(model, opt, x, y):
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


# -- Accelerate's checkpointing example, converted -------------------------------------------------
CHECKPOINT_EVERY = 3


def accelerate_loop(directory, resume_from):
    """The loop of Accelerate's `examples/by_feature/checkpointing.py` as phalanx runs it: a
    checkpoint `step_N` every CHECKPOINT_EVERY steps; resumed from one, the epoch to start in
    and the steps already taken in it come from N and `len(loader)`. px.load puts the sampler
    at the next batch, so where the example skips `resume_step` batches the conversion only
    counts them. No `set_epoch`: a complete pass advances the sampler's epoch by itself.
    Returns the steps this run trained, the epochs the loop entered, the lengths it saw after
    the load and the state at the end."""
    torch.manual_seed(0)
    model, opt, loader = build("ddp", 0.0, seed=7 if resume_from else 0)
    overall_step, starting_epoch, resume_step, lengths = 0, 0, None, None
    if resume_from is not None:
        px.load(os.path.join(directory, resume_from), model=model, optimizer=opt,
                sampler=loader.sampler)
        lengths = (len(loader), loader.batches_left(), len(loader.sampler),
                   loader.sampler.samples_left())
        resume_step = int(resume_from.replace("step_", ""))
        starting_epoch = resume_step // len(loader)
        resume_step -= starting_epoch * len(loader)
    epochs, trained = [], 0
    for epoch in range(starting_epoch, EPOCHS):
        epochs.append(epoch)
        if resume_step is not None and epoch == starting_epoch:
            overall_step += resume_step
        for x, y in loader:
            step_on(model, opt, x, y)
            overall_step += 1
            trained += 1
            if overall_step % CHECKPOINT_EVERY == 0:
                px.save(os.path.join(directory, f"step_{overall_step}"), model=model,
                        optimizer=opt, sampler=loader.sampler)
    return trained, epochs, lengths, state_of(model, opt)


# -- the docs' loop: for epoch: set_epoch(epoch); for x, y in loader -----------------------------
def _loader(kind):
    """px.data_loader (with a loader worker: "workers"; with two, over a dataset that augments
    at random: "augment"), or a plain torch DataLoader over px.DistributedSampler ("torch")."""
    if kind in ("px", "workers"):
        return px.data_loader(dataset(), PER_RANK, seed=5, num_workers=int(kind == "workers"))
    if kind == "augment":
        return px.data_loader(Augmented(dataset()), PER_RANK, seed=5, num_workers=2)
    sampler = px.DistributedSampler(dataset(), seed=5, batch_size=PER_RANK)
    return torch.utils.data.DataLoader(dataset(), batch_size=PER_RANK, sampler=sampler)


def epoch_loop(directory, layouts, save_at, resume):
    """For each (strategy, loader kind) with Dropout(0.3): the whole run, saving after each
    step of `save_at` on the way (`resume` False); or, from each of those checkpoints in turn,
    the run resumed in this fresh job. Returns {(strategy, kind, save step or None): state
    at the end}."""
    out = {}
    for strategy, kind in layouts:
        for at in (save_at if resume else [None]):
            torch.manual_seed(100 + px.rank())  # each rank its own dropout masks
            model, opt, _ = build(strategy, 0.3, seed=7 if resume else 0)
            loader = _loader(kind)
            step, first_epoch = 0, 0
            if resume:
                torch.manual_seed(12345)  # a state the load must replace
                step = px.load(os.path.join(directory, f"{strategy}-{kind}-{at}"), model=model,
                               optimizer=opt, sampler=loader.sampler)["step"]
                first_epoch = step // len(loader)
            for epoch in range(first_epoch, EPOCHS):
                loader.sampler.set_epoch(epoch)
                for x, y in loader:
                    step_on(model, opt, x, y)
                    step += 1
                    if not resume and step in save_at:
                        px.save(os.path.join(directory, f"{strategy}-{kind}-{step}"),
                                model=model, optimizer=opt, sampler=loader.sampler, step=step)
            assert step == EPOCHS * len(loader)
            out[strategy, kind, at] = state_of(model, opt)
    return out
