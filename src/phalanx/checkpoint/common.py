"""What saving and loading share: file names, agreeing on errors, RNG states."""

from __future__ import annotations

import random

import numpy as np
import torch

from ..comm.collectives import Comm
from ..comm.gate import step_lost
from .reader import CheckpointError

__all__ = ["STATE_FILE", "LOSS_SCALER", "MODEL", "OPTIM", "model_key", "optim_key",
           "optim_parts", "under", "is_stateful", "agree", "rng_state", "set_rng_state",
           "mismatches"]

STATE_FILE = "state.pt"  # rank 0's small state: stateful objects, values, RNG, optimizer groups
LOSS_SCALER = "model.loss_scaler"  # where a prepared fp16 model's loss scaler is kept

# The tensors of a checkpoint are named by what they hold, under these prefixes:
MODEL = "model/"        # model/<parameter or buffer name>: its value
OPTIM = "optim/"        # optim/<parameter name>/<state key>: its optimizer state (its shape)
# and <part>/... for each part's own (PowerSGD's powersgd/, staleness=1's grad/, DiLoCo's
# diloco/): see [Note: a part in a checkpoint] in engine/part.py


def model_key(name: str) -> str:
    return MODEL + name


def optim_key(param: str, key: str) -> str:
    return f"{OPTIM}{param}/{key}"


def optim_parts(name: str) -> tuple[str, str]:
    """(parameter name, state key) of an optimizer state tensor's name."""
    param, key = name[len(OPTIM):].rsplit("/", 1)
    return param, key


def under(prefix: str, named: dict) -> dict:
    """The entries of `named` whose names start with `prefix`, by the rest of their names."""
    return {k[len(prefix):]: v for k, v in named.items() if k.startswith(prefix)}


def is_stateful(value) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


def agree(comm: Comm, error: str | None, what: str, saving: bool = False) -> None:
    """Raise on every rank if any rank had an error, naming the ranks and their errors.

    A save does not raise when the step was lost meanwhile (`phalanx run --on-failure
    continue`): it is abandoned then (its caller asks step_lost() next), and the error of a
    rank whose partial checkpoint another rank removed on seeing the loss first is no error
    of the job's (it once ended a survivor)."""
    errors = comm.all_gather_object(error, tag=what)
    if saving and step_lost():
        return
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise CheckpointError(f"{what} failed ({detail})")


def rng_state() -> dict:
    """This rank's generators: CPU, Python, NumPy, and its own GPU's (the current device's;
    not every GPU's, which a later run that sees fewer GPUs could not restore)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # saved as every GPU's: take this device's
            cuda = cuda[min(torch.cuda.current_device(), len(cuda) - 1)] if cuda else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)




def mismatches(missing: list[str], unexpected: list[str], reshaped: list[str]) -> list[str]:
    """How a checkpoint's names differ from a model's, one phrase for each kind that occurs."""
    found = []
    if missing:
        found.append(f"missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        found.append(f"not in the model: {', '.join(unexpected)}")
    if reshaped:
        found.append(f"other shapes: {', '.join(reshaped)}")
    return found
