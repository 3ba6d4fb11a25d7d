"""Rank 1 fails on the first attempt only; later attempts succeed.

The elastic agent counts restarts in TORCHELASTIC_RESTART_COUNT, so with `--max-restarts 1`
the job succeeds on its second attempt and every rank prints `ATTEMPT rank=R restart=1`.
"""

import os
import sys

import phalanx as px

restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
px.init()
if restart == 0 and px.rank() == 1:
    sys.exit(3)
px.barrier()
print(f"ATTEMPT rank={px.rank()} restart={restart}")
px.shutdown()
