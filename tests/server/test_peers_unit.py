"""Peers (sluice/server/peers.py): three workers' lines to each other in one event loop, over
real ZMQ sockets: a gather gets every other worker's reply, overlapping calls get their own,
a worker that does not answer is left out after the timeout, and one whose handler raised or
that left (closed its Peers) is left out at once: those tests set the timeout to 10 minutes
and fail if the gather takes a minute."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sluice.messages import PeerAbortReply, PeerAbortReq, PeerStateReply, PeerStateReq
from sluice.server import peers as peers_module
from sluice.server.peers import Peers


def _answer(index: int, how: str = "answers") -> Any:
    """`how`: "answers", "raises", "has no answer", or "hangs" (until cancelled)."""

    async def handle(msg: Any) -> Any:
        if how == "raises":
            raise RuntimeError("the handler broke")
        if how == "has no answer":
            return None
        if how == "hangs":
            await asyncio.Event().wait()
        match msg:
            case PeerAbortReq():
                await asyncio.sleep(0.01 * index)  # replies come back out of order
                return PeerAbortReply(msg.seq, index, index * 10 + (msg.rid == "x"))
            case PeerStateReq():
                return PeerStateReply(msg.seq, index, 100 + index, index)
        return None

    return handle


def _group(tmp_path: Path, hows: list[str]) -> list[Peers]:
    """Workers that answer as `hows` says; "silent": its receive loop never starts."""
    addrs = tuple(f"ipc://{tmp_path}/peer-{i}" for i in range(len(hows)))
    group = [Peers(i, addrs) for i in range(len(hows))]
    for i, peers in enumerate(group):
        if hows[i] != "silent":
            peers.start(_answer(i, hows[i]))
    return group


def test_gather_gets_every_other_workers_reply(tmp_path: Path) -> None:
    async def go() -> tuple[list[Any], list[Any], list[Any]]:
        group = _group(tmp_path, ["answers"] * 3)
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
        group = _group(tmp_path, ["answers", "answers", "silent"])
        try:
            return await group[0].gather(lambda seq, me: PeerStateReq(seq, me))
        finally:
            for peers in group:
                await peers.close()

    assert [r.worker for r in asyncio.run(go())] == [1]


@pytest.mark.parametrize("how", ["raises", "has no answer"])
def test_a_worker_that_fails_to_answer_is_left_out_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setattr(peers_module, "GATHER_TIMEOUT_S", 600.0)

    async def go() -> tuple[list[Any], list[Any]]:
        group = _group(tmp_path, ["answers", how, "answers"])
        try:
            states = await asyncio.wait_for(
                group[0].gather(lambda seq, me: PeerStateReq(seq, me)), 60
            )
            aborts = await asyncio.wait_for(
                group[2].gather(lambda seq, me: PeerAbortReq(seq, me, rid="x")), 60
            )
        finally:
            for peers in group:
                await peers.close()
        return states, aborts

    states, aborts = asyncio.run(go())
    assert [r.worker for r in states] == [2]
    assert [r.num_aborted for r in aborts] == [1]  # worker 0's: 0 * 10 + (rid == "x")


def test_a_leaving_worker_is_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker 2 hangs on the first call, then leaves (closes its Peers): the call in flight
    ends, and a later call does not ask it."""
    monkeypatch.setattr(peers_module, "GATHER_TIMEOUT_S", 600.0)

    async def go() -> tuple[list[Any], list[Any]]:
        group = _group(tmp_path, ["answers", "answers", "hangs"])
        try:
            call = asyncio.create_task(group[0].gather(lambda seq, me: PeerStateReq(seq, me)))
            await asyncio.sleep(0)  # sent: worker 2 is in its handler, or about to be
            await group[2].close()
            during = await asyncio.wait_for(call, 60)
            after = await asyncio.wait_for(
                group[0].gather(lambda seq, me: PeerStateReq(seq, me)), 60
            )
        finally:
            await group[0].close()
            await group[1].close()
        return during, after

    during, after = asyncio.run(go())
    assert [r.worker for r in during] == [1]
    assert [r.worker for r in after] == [1]
