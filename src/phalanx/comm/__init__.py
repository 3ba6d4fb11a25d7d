"""The communication layer, one floor above the world: `Comm`, through which every collective
phalanx issues goes (`collectives.py`), its completion (`completion.py`), its record
(`records.py`) and its checked form (`mismatch.py`); the groups phalanx makes (`groups.py`);
objects on the wire (`pickled.py`); the one place a device value is read on the host
(`host.py`); and the wire's switch for a lost step under `--on-failure continue` (`gate.py`,
`cut.py`), the part of continue mode every collective reads, and the calls the floors below
make of continue mode (`continuation.py`)."""
