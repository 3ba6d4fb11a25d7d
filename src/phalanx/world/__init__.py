"""The ground floor: this process in its job. Everything kept per process from `px.init` to
`px.shutdown` (`process.py`), the `PHALANX_*` variables read and checked in one table
(`environment.py`), the launcher's environment and the machine's process count (`launch_env.py`,
`processes.py`), `px.init`'s argument checks (`init_options.py`), rank, world size and device
(`runtime.py`), and how a rank's script ends (`leaving.py`). It imports nothing above it but
`runtime.py`, `px.init`, which stands above comm/ and faults/: it joins a group and starts the
hang watcher (tests/test_layout.py's floors)."""
