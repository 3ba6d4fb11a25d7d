"""`phalanx.collectives.Comm`, the name earlier documentation gave the Comm a script may pass to
`px.prepare(comm=...)`: it lives in comm/collectives.py, with the communication layer."""

from .comm.collectives import Comm

__all__ = ["Comm"]
