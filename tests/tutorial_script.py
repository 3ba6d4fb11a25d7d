"""A training script shaped like torch's DDP tutorial (pytorch/examples,
distributed/ddp-tutorial-series/multigpu_torchrun.py), converted to phalanx as
docs/getting-started/coming-from.md says, for tests/test_script_endings.py.

Its `Trainer` trains a few epochs and rank 0 alone saves a snapshot every `save_every` epochs
with `torch.save(px.unwrap(model).state_dict())` (the tutorial's `model.module.state_dict()`),
while the other ranks train on. Then each rank reaches its end in its own way (`ENDINGS`), the
other ranks first: rank 0 waits until each of them has (an event: a file each writes there),
then saves a last snapshot (with `optimizer.state_dict()`) and evaluates under
`torch.no_grad()` alone, both reading the other ranks' shards, and ends in its own way.

Run as a script (one process per rank, the launcher's environment set, as torchrun does):
    python tests/tutorial_script.py OUT STRATEGY ENDING_OF_RANK_0 ENDING_OF_RANK_1 ...
        [--timeout S]
Each rank prints `END rank=R t=TIME` when it reaches its end; rank 0 prints `FINAL t=TIME`
after its last snapshot and evaluation.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group  # bound by name, as the tutorial does
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phalanx as px

ROWS, BATCH, EPOCHS, SAVE_EVERY = 32, 4, 4, 2  # BATCH rows per rank per step
# How a rank ends: torch's destroy_process_group() under the name bound above (torch's own) or
# as torch.distributed.destroy_process_group() (phalanx's route), px.shutdown(), returning
# from main, sys.exit(0), killed by SIGKILL, or an exception.
ENDINGS = ("destroy", "dist.destroy", "shutdown", "return", "sys.exit", "killed", "raise")


def dataset():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, 20, generator=g, dtype=torch.float64)
    return TensorDataset(x, x[:, :3].sum(dim=1, keepdim=True).tanh())


def held_out():
    g = torch.Generator().manual_seed(8)
    return torch.randn(16, 20, generator=g, dtype=torch.float64)


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, out, rank):
        self.model, self.train_data, self.optimizer = model, train_data, optimizer
        self.save_every, self.out, self.rank = save_every, out, rank

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        F.mse_loss(self.model(source), targets).backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": px.unwrap(self.model).state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, os.path.join(self.out, f"snapshot{epoch}.pt"))

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def reference(out):
    """One process, the whole batch, plain torch: what rank 0's files must hold."""
    model, optimizer = build()
    loader = DataLoader(dataset(), batch_size=2 * BATCH)
    Trainer(model, loader, optimizer, SAVE_EVERY, out, 0).train(EPOCHS)
    with torch.no_grad():
        evaluation = model(held_out())
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "evaluation": evaluation}


def _mark(out, name):
    with open(os.path.join(out, f"{name}.partial"), "w") as f:
        f.write(f"{time.time()}\n")
    os.replace(os.path.join(out, f"{name}.partial"), os.path.join(out, name))


def _reach_end(out, rank, ending):
    """This rank has reached its end: say so (the event rank 0 waits for), then end."""
    if ending in ("return", "sys.exit"):  # at exit, before phalanx's own handler
        atexit.register(_mark, out, f"ended.{rank}")
    if ending in ("shutdown", "dist.destroy"):
        _mark(out, f"ended.{rank}")  # these wait for rank 0: say so before
    print(f"END rank={rank} t={time.time()}", flush=True)
    if ending == "destroy":
        destroy_process_group()
        _mark(out, f"ended.{rank}")
    elif ending == "dist.destroy":
        torch.distributed.destroy_process_group()
    elif ending == "shutdown":
        px.shutdown()
    elif ending == "sys.exit":
        sys.exit(0)
    elif ending == "killed":
        _mark(out, f"ended.{rank}")
        os.kill(os.getpid(), signal.SIGKILL)
    elif ending == "raise":
        _mark(out, f"ended.{rank}")
        raise RuntimeError(f"rank {rank} fails at its end")


def train_and_end(out, strategy, endings, slow=0.0):
    """The tutorial's main(): train, snapshots on rank 0, then each rank's ending (rank 0's
    last, after its final snapshot and evaluation alone)."""
    rank, world = px.rank(), px.world_size()
    model, optimizer = build()
    model, optimizer = px.prepare(model, optimizer, strategy=strategy)
    sampler = DistributedSampler(dataset(), num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset(), batch_size=BATCH, sampler=sampler)
    Trainer(model, loader, optimizer, SAVE_EVERY, out, rank).train(EPOCHS)
    if rank != 0:
        return _reach_end(out, rank, endings[rank])
    for peer in range(1, world):
        while not os.path.exists(os.path.join(out, f"ended.{peer}")):
            time.sleep(0.01)
        if endings[peer] in ("return", "sys.exit", "killed"):
            time.sleep(0.5)  # its process would be gone by now without the wait at its end
    time.sleep(slow)  # rank 0's extra work before its last snapshot
    model.eval()
    with torch.no_grad():
        evaluation = model(held_out())
    torch.save({"MODEL_STATE": px.unwrap(model).state_dict(),
                "OPTIMIZER": optimizer.state_dict(), "EVALUATION": evaluation},
               os.path.join(out, "final.pt"))
    print(f"FINAL t={time.time()}", flush=True)
    _reach_end(out, rank, endings[0])


def main(argv):
    out, strategy = argv[0], argv[1]
    endings = [a for a in argv[2:] if a in ENDINGS]
    timeout = float(argv[argv.index("--timeout") + 1]) if "--timeout" in argv else 600.0
    # Every rank has imported torch before any joins: a short --timeout bounds joining too,
    # and two cores start three processes seconds apart.
    _mark(out, f"ready.{os.environ['RANK']}")
    while not all(os.path.exists(os.path.join(out, f"ready.{r}"))
                  for r in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.01)
    px.init(timeout=timeout)
    train_and_end(out, strategy, endings)


if __name__ == "__main__":
    main(sys.argv[1:])
