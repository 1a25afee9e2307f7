"""Peers: an HTTP worker's line to the other workers of the same server (--tokenizer-worker-num).

Each worker binds a PULL at `addrs.peers[index]` and has a PUSH to every other one. `gather`
sends a request (a `messages.ToPeer` with a fresh `seq`) to every other worker and returns their
replies; `tell` sends a message that wants none. Arriving requests go to `handler` (on the event
loop; it may be a coroutine function) and its reply goes back to the sender. Replies are matched
to their call by `seq`, so calls of any kind may overlap; a late reply (past GATHER_TIMEOUT_S) is
dropped. The receive loop outlives any one bad message.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from sluice.messages import PeerAbortReply, PeerMetricsReply, PeerStateReply, ToPeer
from sluice.utils import ipc

logger = logging.getLogger(__name__)

GATHER_TIMEOUT_S = 10.0
INBOX = ipc.Inbox(ToPeer)
REPLY_TYPES = (PeerAbortReply, PeerStateReply, PeerMetricsReply)


class Peers:
    def __init__(self, index: int, addrs: tuple[str, ...]) -> None:
        self.index = index
        self.pid = os.getpid()
        self.num_workers = len(addrs)
        self._ctx = zmq.asyncio.Context()
        sync_ctx = zmq.Context.shadow(self._ctx)
        self._recv_sock = ipc.pull_socket(self._ctx, addrs[index])
        self._to = {i: ipc.push_socket(sync_ctx, a) for i, a in enumerate(addrs) if i != index}
        self._seq = itertools.count(1)
        self._calls: dict[int, tuple[list[Any], asyncio.Future[None], int]] = {}
        self._handler: Callable[[Any], Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._answering: set[asyncio.Task[None]] = set()

    def start(self, handler: Callable[[Any], Any]) -> None:
        """`handler(request)` returns the reply to send back (None: nothing to send)."""
        self._handler = handler
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for sock in (*self._to.values(), self._recv_sock):
            sock.close(linger=0)
        self._ctx.term()

    def tell(self, msg: Any) -> None:
        for sock in self._to.values():
            ipc.send(sock, msg)

    async def gather(self, make: Callable[[int, int], Any]) -> list[Any]:
        """`make(seq, sender)` builds the request; the replies of every other worker (503-free:
        a worker that does not answer within GATHER_TIMEOUT_S is left out, and logged)."""
        if not self._to:
            return []
        seq = next(self._seq)
        replies: list[Any] = []
        done = asyncio.get_running_loop().create_future()
        self._calls[seq] = (replies, done, len(self._to))
        try:
            self.tell(make(seq, self.index))
            await asyncio.wait_for(asyncio.shield(done), GATHER_TIMEOUT_S)
        except TimeoutError:
            logger.warning("%d of %d workers did not answer", len(self._to) - len(replies),
                           len(self._to))  # fmt: skip
        finally:
            del self._calls[seq]
        return list(replies)

    async def _loop(self) -> None:
        while True:
            data = await self._recv_sock.recv()
            try:
                self._dispatch(INBOX.decode(data))
            except Exception:
                logger.exception("failed to handle a message from another worker")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, REPLY_TYPES):
            call = self._calls.get(msg.seq)
            if call is None:
                return  # its call timed out
            replies, done, expected = call
            replies.append(msg)
            if len(replies) == expected and not done.done():
                done.set_result(None)
            return
        task = asyncio.get_running_loop().create_task(self._answer(msg))
        self._answering.add(task)  # a request's handling never holds up the replies
        task.add_done_callback(self._answering.discard)

    async def _answer(self, msg: Any) -> None:
        assert self._handler is not None
        try:
            reply = self._handler(msg)
            if inspect.isawaitable(reply):
                reply = await reply
        except Exception:
            logger.exception("failed to answer a %s", type(msg).__name__)
            return
        if reply is not None:
            ipc.send(self._to[msg.sender], reply)
