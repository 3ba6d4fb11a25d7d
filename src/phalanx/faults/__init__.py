"""What goes wrong in a data-parallel job, caught where it happens and named.

- `hangs`: the hang watcher (a collective that waited too long, or waits on a peer that has
  reached its end), then every rank ends (under `--on-failure continue`, the ranks it names
  are removed instead); `hang_report`: its message (which rank, which collective, each
  rank's stack).
- `mismatch`: checked collectives (PHALANX_CHECK_COLLECTIVES=1).
- `nonfinite`: a NaN or inf loss on any rank, seen at the end of backward (`NonFiniteError`).
- `replica_check`: every K steps, do the ranks still hold the same parameters (`ReplicasDiffer`).
"""
