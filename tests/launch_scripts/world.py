"""Join the job, prove the group works with an all-reduce, print what this rank sees.

Prints one line per rank: `WORLD rank=R world=W local=L sum=S threads=T`, where S is the sum
of all ranks (computed over the group) and T is OMP_NUM_THREADS as the worker sees it. Extra
arguments are echoed as `ARGS ...` so a test can check they arrive.
"""

import os
import sys

import torch
import torch.distributed as dist

import phalanx as px

px.init()
total = torch.tensor([float(px.rank())])
if px.world_size() > 1:
    dist.all_reduce(total)
print(f"WORLD rank={px.rank()} world={px.world_size()} local={px.local_rank()} "
      f"sum={int(total.item())} threads={os.environ.get('OMP_NUM_THREADS')}")
if sys.argv[1:]:
    print("ARGS", " ".join(sys.argv[1:]))
px.shutdown()
