"""Watching a run: where each step's time, bytes and memory went, and where it is written.

- `step_report`: the per-step report of every prepared model (`px.step_stats`).
- `trace`: a Perfetto timeline per rank (PHALANX_TRACE).
- `metrics`: `px.log` and `px.progress`, written by rank 0 to the run directory.
- `report_cli`: `phalanx report RUN_DIR`, plots and a summary of a run directory.
"""
