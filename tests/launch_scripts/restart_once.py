"""Rank 1 fails (sys.exit(3)) on the first attempt only, or on every attempt with `--always`.

The elastic agent counts restarts in TORCHELASTIC_RESTART_COUNT, so with `--max-restarts 1`
the job succeeds on its second attempt and every rank prints `ATTEMPT rank=R restart=1`.
"""

import os
import sys

import phalanx as px

restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
always = "--always" in sys.argv  # fail on every attempt
px.init()
if (restart == 0 or always) and px.rank() == 1:
    sys.exit(3)
px.barrier()
print(f"ATTEMPT rank={px.rank()} restart={restart}")
px.shutdown()
