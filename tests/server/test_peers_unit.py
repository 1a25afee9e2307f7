"""Peers (sluice/server/peers.py): three workers' lines to each other in one event loop, over
real ZMQ sockets: a gather gets every other worker's reply, overlapping calls get their own,
and a worker that does not answer is left out after the timeout."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sluice.messages import PeerAbortReply, PeerAbortReq, PeerStateReply, PeerStateReq
from sluice.server import peers as peers_module
from sluice.server.peers import Peers


def _answer(index: int, answers: bool = True) -> Any:
    async def handle(msg: Any) -> Any:
        if not answers:
            return None
        match msg:
            case PeerAbortReq():
                await asyncio.sleep(0.01 * index)  # replies come back out of order
                return PeerAbortReply(msg.seq, index * 10 + (msg.rid == "x"))
            case PeerStateReq():
                return PeerStateReply(msg.seq, index, 100 + index, index)
        return None

    return handle


def _group(tmp_path: Path, answering: list[bool]) -> list[Peers]:
    addrs = tuple(f"ipc://{tmp_path}/peer-{i}" for i in range(len(answering)))
    group = [Peers(i, addrs) for i in range(len(answering))]
    for i, peers in enumerate(group):
        peers.start(_answer(i, answering[i]))
    return group


def test_gather_gets_every_other_workers_reply(tmp_path: Path) -> None:
    async def go() -> tuple[list[Any], list[Any], list[Any]]:
        group = _group(tmp_path, [True, True, True])
        try:
            aborts, states = await asyncio.gather(
                group[0].gather(lambda seq, me: PeerAbortReq(seq, me, rid="x")),
                group[0].gather(lambda seq, me: PeerStateReq(seq, me)),
            )
            from_two = await group[2].gather(lambda seq, me: PeerAbortReq(seq, me, rid="y"))
        finally:
            for peers in group:
                await peers.close()
        return aborts, states, from_two

    aborts, states, from_two = asyncio.run(go())
    assert sorted(r.num_aborted for r in aborts) == [11, 21]
    assert sorted((r.worker, r.pid) for r in states) == [(1, 101), (2, 102)]
    assert sorted(r.num_aborted for r in from_two) == [0, 10]


def test_a_silent_worker_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers_module, "GATHER_TIMEOUT_S", 0.3)

    async def go() -> list[Any]:
        group = _group(tmp_path, [True, True, False])
        try:
            return await group[0].gather(lambda seq, me: PeerStateReq(seq, me))
        finally:
            for peers in group:
                await peers.close()

    assert [r.worker for r in asyncio.run(go())] == [1]
