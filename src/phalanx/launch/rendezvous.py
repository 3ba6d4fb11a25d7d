"""The rendezvous of `phalanx run`: torch's static TCP rendezvous, a fresh store per attempt."""

from __future__ import annotations

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

__all__ = ["StaticRendezvous", "RUN_ID", "RENDEZVOUS"]

# The run id names the rendezvous on the master's store, so every node must use the same one.
RUN_ID = "phalanx"
RENDEZVOUS = "phalanx-static"  # the backend name the agent reports for it


class StaticRendezvous(StaticTCPRendezvous):
    """[Note: static rendezvous, a fresh store per attempt]

    The job has a fixed shape, so the rendezvous is torch's static one: node 0's agent serves a
    TCP store at master addr:port, every node knows its rank (--node-rank), and nothing beyond
    torch is needed (no etcd, no elastic membership).

    One change: torch's static rendezvous lends that store to the workers and keeps it across
    restarts, so after a restart the process-group keys of the failed attempt are still there
    and a worker connects to a dead peer's address (torch 2.13, with `torchrun
    --max-restarts` as well; see pytorch/pytorch#135712). Here the global rank 0 worker
    serves a new store on a free port at every attempt, the address being shared through the
    agents' store under a per-attempt key: what torch's dynamic rendezvous does with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.

    Under `--on-failure continue` (`share_store`) the workers use the agent's store instead:
    it must outlive any worker, rank 0's included, and there is one attempt only (a failed
    worker is replaced in it, launch/continuing.py), so no keys of an earlier attempt remain.
    """

    def __init__(self, master_addr: str, master_port: int, node_rank: int, nnodes: int,
                 timeout: int, share_store: bool = False):
        super().__init__(master_addr, master_port, node_rank, nnodes, RUN_ID, timeout)
        self._attempt = 0
        self._share_store = share_store

    def get_backend(self) -> str:
        return RENDEZVOUS

    @property
    def use_agent_store(self) -> bool:
        return self._share_store

    def next_rendezvous(self) -> RendezvousInfo:
        info = super().next_rendezvous()
        if self._share_store:  # the workers connect to the agent's store itself
            shared = RendezvousStoreInfo(self.master_addr, self._store.port)
            return RendezvousInfo(info.store, info.rank, info.world_size, shared)
        attempt_store = PrefixStore(f"phalanx/attempt_{self._attempt}", info.store)
        self._attempt += 1
        workers_store = RendezvousStoreInfo.build(info.rank, attempt_store,
                                                  local_addr=self.master_addr)
        return RendezvousInfo(info.store, info.rank, info.world_size, workers_store)
