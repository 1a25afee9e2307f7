"""WorkerGroup: what the routes of one HTTP worker ask of every worker of the server.

With --tokenizer-worker-num 1 there are no peers and each call is this worker's alone (the
path of a server with one HTTP process). With N > 1, a request owned by one worker may be
named through any other: an abort by rid, abort_all, the request states of /get_server_info
and the counters of /metrics are this worker's part plus every other worker's, gathered over
`Peers`. Everything held by the scheduler (sessions, the cache, pause) needs no fan-out: any
worker's message reaches the one scheduler, and its reply comes back to the asker.
"""

from __future__ import annotations

import os
from typing import Any

from sluice.messages import (
    MetricSample,
    PeerAbortReply,
    PeerAbortReq,
    PeerMetricsReply,
    PeerMetricsReq,
    PeerStateReply,
    PeerStateReq,
)
from sluice.server.metrics import ServerMetrics
from sluice.server.peers import Peers
from sluice.tokenizer.main_model import MainModel


class WorkerGroup:
    def __init__(
        self, tm: MainModel, embedders: list[Any], metrics: ServerMetrics, peers: Peers | None
    ) -> None:
        self.tm, self.embedders, self.metrics, self.peers = tm, embedders, metrics, peers

    @property
    def index(self) -> int:
        return 0 if self.peers is None else self.peers.index

    # ---- calls of the routes --------------------------------------------------------------

    async def abort(self, rid: str | None) -> int:
        """The request `rid` (or the batch the client named so), whichever worker owns it;
        400 (here, before any peer is asked) without a rid."""
        num = int(await self.tm.abort_request(rid=rid) or 0)
        if self.peers is not None:
            replies = await self.peers.gather(lambda seq, me: PeerAbortReq(seq, me, rid=rid or ""))
            num += sum(r.num_aborted for r in replies)
        return num

    async def abort_all(self) -> int:
        """Every request of every model of every worker (pooled ones with 499)."""
        num = await self._abort_all_here()
        if self.peers is not None:
            replies = await self.peers.gather(lambda seq, me: PeerAbortReq(seq, me, abort_all=True))
            num += sum(r.num_aborted for r in replies)
        return num

    async def req_states(self) -> list[PeerStateReply]:
        """Every worker's request states, this one's first."""
        here = self._state_here(0, 0)
        if self.peers is None:
            return [here]
        return [here, *await self.peers.gather(lambda seq, me: PeerStateReq(seq, me))]

    async def peer_metrics(self) -> list[PeerMetricsReply]:
        if self.peers is None:
            return []
        return await self.peers.gather(lambda seq, me: PeerMetricsReq(seq, me))

    # ---- answers to the other workers -----------------------------------------------------

    async def handle(self, msg: Any) -> Any | None:
        match msg:
            case PeerAbortReq(abort_all=True):
                return PeerAbortReply(msg.seq, self.index, await self._abort_all_here())
            case PeerAbortReq():
                num = int(await self.tm.abort_request(rid=msg.rid) or 0)
                return PeerAbortReply(msg.seq, self.index, num)
            case PeerStateReq():
                return self._state_here(msg.seq, msg.sender)
            case PeerMetricsReq():
                m = self.metrics
                samples = [MetricSample(*s) for s in m.additive_samples()]
                return PeerMetricsReply(
                    msg.seq, self.index, samples, m.num_prompt_tokens, m.num_cached_tokens
                )
        return None

    async def _abort_all_here(self) -> int:
        num = int(await self.tm.abort_request(abort_all=True) or 0)
        for encoder in self.embedders:
            num += encoder.abort_all(499, "request_aborted", "the request was aborted")
        return num

    def _state_here(self, seq: int, sender: int) -> PeerStateReply:
        pid = os.getpid()
        pending = {e.model_name: len(e.pending) for e in self.embedders}
        return PeerStateReply(seq, self.index, pid, self.tm.num_req_states(), pending)
