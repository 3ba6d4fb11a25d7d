"""Checkpoints that resume anywhere: `px.save`, `px.load`, `px.latest_checkpoint`, `px.export`.

A checkpoint is a directory:

    manifest.json          written last: what every tensor is (name, shape, dtype), which
                           files hold which element ranges of it, each file's size and CRC-32,
                           the world size, strategy and precision it was saved with,
                           and the job that wrote it (ownership.py)
    rank00000.safetensors  one per rank: the ranges that rank wrote, as safetensors
    state.pt               rank 0's small state: stateful objects (sampler, scheduler, the fp16
                           loss scaler), plain values, every rank's RNG states, and the
                           optimizer's param groups and step counts

See [Note: what a checkpoint stores] in state.py for how tensors are named and split, which is
what makes a checkpoint load at any world size, strategy and precision.

Why not torch.distributed.checkpoint (DCP) as the storage layer: DCP reshards by intersecting
N-d boxes (chunks) of a tensor, but a rank's ZeRO shard is a range of a unit's flat buffer, so
its part of a parameter is a range of the flattened parameter, which is in general not a box
(it starts and ends inside rows); described to DCP it would be a 1-D tensor anyway, and plain
tensors that differ per rank under one key are taken as replicated and silently lost (pytorch
issue 120356). Ranges of flattened tensors, named as above, are what the engine holds, need
no planner, and read back with `safetensors.safe_open(...).get_slice`, which reads only the
bytes asked for. The files are safetensors, so any tool can open them.

DCP checkpoints (FSDP2's, torchtitan's) are read by `px.load` and written by
`px.save(..., format="dcp")` beside this format, through DCP's own API: dcp.py.
"""

from .api import export, export_checkpoint, latest_checkpoint, load
from .reader import CheckpointError
from .saving import save, wait_for_saves

__all__ = ["save", "load", "latest_checkpoint", "export", "export_checkpoint", "wait_for_saves",
           "CheckpointError"]
