"""PowerSGD's state in a checkpoint, by parameter name, so it loads at any world size and
strategy as the optimizer state does.

    powersgd/reductions        how many gradient reductions ran (1 element): a resumed run
                               past `start_step` compresses from its first step
    powersgd/<param>/error     the MEAN over ranks of the parameter's error feedback, flat
    powersgd/<param>/q         its warm-start Q (columns x rank), flat

Only the mean of the error feedback is kept, and every rank of the resumed run starts from it:
the trajectory depends on the ranks' errors only through their mean (see [Note: PowerSGD's
state depends only on means over ranks] in engine/powersgd.py), so this resumes exactly, at
any world size. The tensors are written by one rank each, in turn. A checkpoint saved without
PowerSGD loads into a model with it as a fresh start (no error, Q drawn anew, the count at 0);
a saved Q of another rank than the loading run's is left out (drawn anew), the rest loads.
"""

from __future__ import annotations

import torch

from .common import POWERSGD
from .state import ModelState, Range

__all__ = ["compression_ranges", "load_compression"]

COUNT = f"{POWERSGD}reductions"


def _compressor(model_state: ModelState):
    engine = model_state.engine if model_state is not None else None
    return engine.compression if engine is not None else None


@torch.no_grad()
def compression_ranges(model_state: ModelState) -> list[Range]:
    """This rank's share of the PowerSGD state to save; a collective (the mean of the errors)
    when the model compresses, so every rank calls it."""
    compressor = _compressor(model_state)
    if compressor is None:
        return []
    comm = model_state.comm
    errors = compressor.mean_errors(comm)
    tensors = {COUNT: torch.tensor([compressor.reductions], dtype=torch.int64)}
    for number, p in enumerate(compressor.params):
        name = model_state.names.get(id(p))
        if name is None:
            continue
        if number in errors:
            tensors[f"{POWERSGD}{name}/error"] = errors[number]
        if number in compressor.qs:
            tensors[f"{POWERSGD}{name}/q"] = compressor.qs[number]
    out = []
    for i, (key, value) in enumerate(tensors.items()):  # the same order on every rank
        if i % comm.world == comm.rank:
            values = value.detach().reshape(-1)
            out.append(Range(key, 0, values.numel(), values))
    return out


@torch.no_grad()
def load_compression(model_state: ModelState, reader, names: set[str]) -> None:
    """Give the model's compressor the saved state of the parameters in `names` (every rank
    reads the same: the mean error, the Q, the count)."""
    compressor = _compressor(model_state)
    if compressor is None or COUNT not in reader.tensors:
        return
    compressor.reductions = int(reader.read(COUNT, 0, 1)[0])
    for number, p in enumerate(compressor.params):
        name = model_state.names.get(id(p))
        mat = compressor.matrices.get(number)
        if name not in names or mat is None:
            continue
        error, q = f"{POWERSGD}{name}/error", f"{POWERSGD}{name}/q"
        compressor.load(
            number,
            reader.read(error, 0, p.numel()) if error in reader.tensors else None,
            reader.read(q, 0, mat.m * mat.r)
            if q in reader.tensors and reader.numel(q) == mat.m * mat.r else None)
