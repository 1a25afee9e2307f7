"""ModelClient over real ZMQ sockets, with the test standing in for the model's processes: it
reads what the client sends and pushes outputs, replies and heartbeats back."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from sluice.aborts import aborted
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    FlushCacheReply,
    FlushCacheReq,
    OpenSessionReply,
    OpenSessionReq,
    SchedulerHeartbeat,
    ToDetokenizer,
    ToScheduler,
)
from sluice.tokenizer import model_client
from sluice.tokenizer.model_client import ModelClient
from sluice.tokenizer.normalize import RequestError
from sluice.utils import ipc

REPLIES = (FlushCacheReply, OpenSessionReply)


@dataclasses.dataclass
class Peer:
    """The model's end: what the scheduler and detokenizer got, and a socket back."""

    addrs: ipc.IpcAddrs
    scheduler: zmq.Socket
    detokenizer: zmq.Socket
    back: zmq.Socket | None = None

    def received(self, sock: zmq.Socket) -> list[Any]:
        inbox = ipc.Inbox(ToScheduler if sock is self.scheduler else ToDetokenizer)
        return [inbox.decode(data) for data in ipc.recv_all(sock, 100)]


@pytest.fixture
def peer() -> Iterator[Peer]:
    addrs = ipc.IpcAddrs.create()
    ctx = zmq.Context()
    p = Peer(
        addrs, ipc.pull_socket(ctx, addrs.scheduler_in), ipc.pull_socket(ctx, addrs.detokenizer_in)
    )
    try:
        yield p
    finally:
        for sock in (p.scheduler, p.detokenizer, p.back):
            if sock is not None:
                sock.close(linger=0)
        ctx.term()
        addrs.remove()


async def _started(peer: Peer, addrs: ipc.IpcAddrs | None = None) -> ModelClient:
    client = ModelClient(addrs or peer.addrs, REPLIES, peer="detokenizer")
    client.start()
    peer.back = ipc.push_socket(zmq.Context.instance(), client.reply_to)
    return client


def test_outputs_go_to_their_handler_and_replies_to_their_callers_in_order(peer: Peer) -> None:
    async def go() -> None:
        client = await _started(peer)
        got: list[Any] = []
        client.on(BatchEmbeddingOutput, got.append)
        output = BatchEmbeddingOutput(["e"], [b""], [1], [aborted()], [client.reply_to])
        first = asyncio.create_task(client.control(FlushCacheReq(), FlushCacheReply))
        second = asyncio.create_task(client.control(FlushCacheReq(), FlushCacheReply))
        await asyncio.sleep(0.05)
        # each carries this client's address: its reply comes back here, whichever worker it is
        flush = FlushCacheReq(reply_to=client.reply_to)
        assert peer.received(peer.scheduler) == [flush, flush]
        assert not client.heartbeat_seen
        for msg in (FlushCacheReply(True), output, FlushCacheReply(False)):
            ipc.send(peer.back, msg)
        ipc.send(peer.back, SchedulerHeartbeat(0, 0))
        assert await asyncio.wait_for(first, 5) == FlushCacheReply(True)
        assert await asyncio.wait_for(second, 5) == FlushCacheReply(False)
        await asyncio.sleep(0.05)
        assert got == [output] and client.heartbeat_seen
        await client.close()

    asyncio.run(go())


def test_child_death_fails_waiting_calls_and_refuses_new_ones(peer: Peer) -> None:
    async def go() -> None:
        client = await _started(peer)
        call = asyncio.create_task(client.control(OpenSessionReq("s", 0.0, 0), OpenSessionReply))
        await asyncio.sleep(0.05)
        client.on_child_death("the scheduler process died")
        with pytest.raises(RequestError) as info:
            await asyncio.wait_for(call, 5)
        assert (info.value.status_code, info.value.message) == (503, "the scheduler process died")
        assert not client.is_healthy
        with pytest.raises(RequestError) as info:
            await client.control(FlushCacheReq(), FlushCacheReply)
        assert info.value.status_code == 503
        await client.close()

    asyncio.run(go())


def test_aborts_reach_the_detokenizer_only_where_there_is_one(peer: Peer) -> None:
    async def go() -> None:
        client = await _started(peer)
        client.send_abort(AbortReq(rid="a"))
        mine = AbortReq(rid="a", reply_to=client.reply_to)  # only this worker's request
        assert peer.received(peer.scheduler) == [mine]
        assert peer.received(peer.detokenizer) == [mine]
        await client.close()
        # an encoder's scheduler answers straight to the client: no detokenizer
        addrs = dataclasses.replace(peer.addrs, detokenizer_in=peer.addrs.tokenizer_in)
        peer.back.close(linger=0)
        encoder = await _started(peer, addrs)
        encoder.send_abort(AbortReq(rid="b"))
        assert peer.received(peer.scheduler) == [AbortReq(rid="b", reply_to=encoder.reply_to)]
        assert peer.received(peer.detokenizer) == []
        await encoder.close()

    asyncio.run(go())


def test_a_burst_of_outputs_arrives_whole_and_in_order_while_the_loop_stays_free(
    peer: Peer,
) -> None:
    """More outputs than one read takes (DRAIN_MAX): every one reaches its handler, in order,
    and other callbacks of the event loop run between the reads; one that cannot be decoded is
    logged and skipped; after close nothing more is read."""

    async def go() -> None:
        client = await _started(peer)
        got: list[tuple[str, int]] = []  # (rid, the ticker's count when it was handled)
        ticks = 0
        client.on(BatchEmbeddingOutput, lambda out: got.append((out.rids[0], ticks)))

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        n = 200
        assert n > 3 * model_client.DRAIN_MAX
        for i in range(n):  # all queued before the loop reads any (no await in between)
            ipc.send(peer.back, BatchEmbeddingOutput([f"r{i}"], [b""], [1], [aborted()], [""]))
            if i == 7:
                peer.back.send(b"not a message")
        time.sleep(0.3)
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(got) == n:
                break
        assert [rid for rid, _ in got] == [f"r{i}" for i in range(n)]
        # read in 4 turns at least, the ticker running between them
        assert len({tick for _, tick in got}) >= 4
        await client.close()
        ipc.send(peer.back, BatchEmbeddingOutput(["late"], [b""], [1], [aborted()], [""]))
        await asyncio.sleep(0.05)
        assert len(got) == n
        task.cancel()

    asyncio.run(go())
