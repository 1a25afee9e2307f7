"""Peers: an HTTP worker's line to the other workers of the same server (--tokenizer-worker-num).

Each worker binds a PULL at `addrs.peers[index]` and has a PUSH to every other one. `gather`
sends a request (a `messages.ToPeer` with a fresh `seq`) to every other worker and returns their
replies; `tell` sends a message that wants none. Arriving requests go to `handler` (on the event
loop; it may be a coroutine function) and its reply goes back to the sender.

Guarantee: every request gets exactly one reply, a PeerErrorReply when the handler raised or had
no answer; a call waits for the workers it asked that have not answered and not announced that
they are leaving (PeerLeaving, sent by `close`), and for none past GATHER_TIMEOUT_S (a late reply
is dropped). So a fan-out waits out the timeout only for a worker that is stuck or died, never
for one that raised or exited after its drain. Replies are matched to their call by `seq`, so
calls of any kind may overlap. The receive loop outlives any one bad message.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from sluice.messages import (
    PeerAbortReply,
    PeerErrorReply,
    PeerLeaving,
    PeerMetricsReply,
    PeerStateReply,
    ToPeer,
)
from sluice.utils import ipc

logger = logging.getLogger(__name__)

GATHER_TIMEOUT_S = 10.0
INBOX = ipc.Inbox(ToPeer)
REPLY_TYPES = (PeerAbortReply, PeerStateReply, PeerMetricsReply, PeerErrorReply)
LEAVING_LINGER_MS = 250  # how long `close` may hold on to a PeerLeaving a peer cannot take


@dataclass
class _Call:
    """One gather in flight: the workers still to answer, and the good replies so far."""

    waiting_for: set[int]
    done: asyncio.Future[None]
    replies: list[Any] = field(default_factory=list)

    def settle(self, worker: int) -> None:
        self.waiting_for.discard(worker)
        if not self.waiting_for and not self.done.done():
            self.done.set_result(None)


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
        self._calls: dict[int, _Call] = {}
        self._handler: Callable[[Any], Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._answering: set[asyncio.Task[None]] = set()

    def start(self, handler: Callable[[Any], Any]) -> None:
        """`handler(request)` returns the reply to send back (None: nothing to send)."""
        self._handler = handler
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        """Stop answering, and tell the others this worker is leaving (so no call of theirs
        waits for it)."""
        tasks = [t for t in (self._task, *self._answering) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._recv_sock.close(linger=0)
        self.tell(PeerLeaving(self.index))
        for sock in self._to.values():
            sock.close(linger=LEAVING_LINGER_MS)  # a dead peer's socket holds it this long
        await asyncio.to_thread(self._ctx.term)

    def tell(self, msg: Any) -> None:
        for sock in self._to.values():
            ipc.send(sock, msg)

    async def gather(self, make: Callable[[int, int], Any]) -> list[Any]:
        """`make(seq, sender)` builds the request; the replies of every other worker (503-free:
        a worker that failed to answer, is leaving, or does not answer within
        GATHER_TIMEOUT_S is left out, and logged)."""
        if not self._to:
            return []
        seq = next(self._seq)
        call = _Call(set(self._to), asyncio.get_running_loop().create_future())
        self._calls[seq] = call
        try:
            self.tell(make(seq, self.index))
            await asyncio.wait_for(asyncio.shield(call.done), GATHER_TIMEOUT_S)
        except TimeoutError:
            logger.warning("workers %s did not answer in %.0f s", sorted(call.waiting_for),
                           GATHER_TIMEOUT_S)  # fmt: skip
        finally:
            del self._calls[seq]
        return list(call.replies)

    async def _loop(self) -> None:
        while True:
            data = await self._recv_sock.recv()
            try:
                self._dispatch(INBOX.decode(data))
            except Exception:
                logger.exception("failed to handle a message from another worker")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, PeerLeaving):
            self._forget(msg.worker)
            return
        if isinstance(msg, REPLY_TYPES):
            call = self._calls.get(msg.seq)
            if call is None:
                return  # its call timed out
            if isinstance(msg, PeerErrorReply):
                logger.warning("worker %d failed to answer: %s", msg.worker, msg.error)
            else:
                call.replies.append(msg)
            call.settle(msg.worker)
            return
        task = asyncio.get_running_loop().create_task(self._answer(msg))
        self._answering.add(task)  # a request's handling never holds up the replies
        task.add_done_callback(self._answering.discard)

    def _forget(self, worker: int) -> None:
        """`worker` is leaving: no call waits for it, and nothing more goes to it."""
        sock = self._to.pop(worker, None)
        if sock is not None:
            sock.close(linger=0)
        for call in self._calls.values():
            call.settle(worker)

    async def _answer(self, msg: Any) -> None:
        """Run the handler; a request (a message with a `seq`) always gets a reply."""
        assert self._handler is not None
        try:
            reply = self._handler(msg)
            if inspect.isawaitable(reply):
                reply = await reply
            if reply is None and hasattr(msg, "seq"):
                reply = PeerErrorReply(msg.seq, self.index, f"no answer to a {type(msg).__name__}")
        except Exception as e:
            logger.exception("failed to answer a %s", type(msg).__name__)
            if not hasattr(msg, "seq"):
                return
            reply = PeerErrorReply(msg.seq, self.index, f"{type(e).__name__}: {e}")
        sock = self._to.get(getattr(msg, "sender", -1))
        if reply is not None and sock is not None:
            ipc.send(sock, reply)
