"""A loop with px.progress on every rank: only rank 0 draws a bar (desc 'work')."""

import time

import phalanx as px

px.init()
for _ in px.progress(range(10), desc=f"work{px.rank()}"):
    time.sleep(0.02)
px.shutdown()
