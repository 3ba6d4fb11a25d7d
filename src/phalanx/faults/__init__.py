"""What goes wrong in a data-parallel job, caught where it happens and named.

- `hangs`: the hang watcher and its report (a collective that waited too long: which rank,
  which collective, each rank's stack), then every rank ends.
- `nonfinite`: a NaN or inf loss on any rank, seen at the end of backward (`NonFiniteError`).
- `replica_check`: every K steps, do the ranks still hold the same parameters (`ReplicasDiffer`).
"""
