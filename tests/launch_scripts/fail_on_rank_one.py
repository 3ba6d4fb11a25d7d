"""Rank 1 raises; the other ranks wait (sleeping, or in a barrier with `--barrier`).

The sleep is long so that a survivor is still running unless the launcher stops it: the test
checks that no process running this script is left afterwards.
"""

import sys
import time

import torch.distributed as dist

import phalanx as px

px.init()
if px.rank() == 1:
    time.sleep(0.5)  # let the other ranks reach their wait first
    raise ValueError("rank one is broken on purpose")
if "--barrier" in sys.argv:
    dist.barrier()
else:
    time.sleep(120)
px.shutdown()
