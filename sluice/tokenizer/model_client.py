"""ModelClient: the HTTP process's plumbing to one model process, shared by its two kinds of
manager (the decoder's TokenizerManager, an encoder model's EncoderManager).

It owns the sockets (a PUSH to the model's scheduler, a PUSH to the detokenizer where there is
one, the PULL that everything comes back on), the receive loop, the control calls and the
health of that model as this process sees it. Request logic stays with the managers: each
registers a handler per output type (`on`) and fails its own requests on a child's death.

Receive loop guarantee: every message (one of `messages.ToHttp`) is handed on in arrival order,
on the event loop: an output to its handler, a control reply to its caller; a message that fails
to decode or to be handled is logged and the loop goes on. Any message, a heartbeat included,
counts as contact (`last_scheduler_contact`); a model whose loop sends no heartbeat is never
judged silent (`heartbeat_seen` stays False).

Control calls: the scheduler answers each kind of control message in the order it got them,
so each reply type this client takes (`replies`) has one FIFO of waiting futures. A call that
times out leaves its done future in line, to take (and drop) the reply that comes late.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    FlushCacheReply,
    InternalStateReply,
    OpenSessionReply,
    SchedulerHeartbeat,
    ToHttp,
)
from sluice.tokenizer.counters import RequestCounters
from sluice.tokenizer.normalize import RequestError
from sluice.utils import ipc

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 60.0
DRAIN_MAX = 64  # messages taken in one callback of the event loop
PROCESS_FAILURE = "the server is shutting down after a process failure"
INBOX = ipc.Inbox(ToHttp)


class HeardFrom(Protocol):
    """A model's liveness as the readiness route judges it (a ModelClient, or its owner)."""

    @property
    def last_scheduler_contact(self) -> float: ...  # time.monotonic() of the last message
    @property
    def heartbeat_seen(self) -> bool: ...  # False: a loop that sends none is not judged


class ModelClient:
    """`addrs.scheduler_in`: where messages go; `addrs.tokenizer_in`: where outputs, replies
    and heartbeats arrive (`reply_to`). The detokenizer (`addrs.detokenizer_in`) gets aborts
    too, unless it is `tokenizer_in` itself: an encoder's scheduler answers straight here.
    `replies`: the control reply types this client's owner asks for. `peer`: who sends to
    `tokenizer_in`, for the logs."""

    def __init__(self, addrs: ipc.IpcAddrs, replies: tuple[type, ...], peer: str) -> None:
        self.reply_to = addrs.tokenizer_in
        self.is_healthy = True  # False once a child died: nothing more is sent
        self.last_scheduler_contact = time.monotonic()
        self.heartbeat_seen = False
        self._peer = peer
        # plain sockets: sends never block (no high-water mark), and the PULL is read on the
        # event loop's readiness callback (`_drain`), not through zmq.asyncio's futures (one a
        # message, several times the CPU of the read itself)
        self._ctx = zmq.Context()
        self._to_scheduler = ipc.push_socket(self._ctx, addrs.scheduler_in)
        self._to_detokenizer = (
            ipc.push_socket(self._ctx, addrs.detokenizer_in) if addrs.has_detokenizer else None
        )
        self._recv_sock = ipc.pull_socket(self._ctx, addrs.tokenizer_in)
        self._handlers: dict[type, Callable[[Any], None]] = {}
        self._waiters: dict[type, deque[asyncio.Future[Any]]] = {t: deque() for t in replies}
        self._loop: asyncio.AbstractEventLoop | None = None

    def on(self, msg_type: type, handler: Callable[[Any], None]) -> None:
        """Hand every arriving output of `msg_type` (BatchStrOutput, BatchEmbeddingOutput) to
        `handler` (on the event loop)."""
        self._handlers[msg_type] = handler

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._recv_sock.getsockopt(zmq.FD), self._drain)
        self._loop.call_soon(self._drain)  # what arrived before the reader was added

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._recv_sock.getsockopt(zmq.FD))
            self._loop = None
        for sock in (self._to_scheduler, self._to_detokenizer, self._recv_sock):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def on_child_death(self, message: str) -> None:
        """Nothing more is sent; every control call waiting fails with 503 `message`."""
        self.is_healthy = False
        for waiters in self._waiters.values():
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(unavailable_error(message))

    def check_healthy(self) -> None:
        if not self.is_healthy:
            raise unavailable_error(PROCESS_FAILURE)

    # ---- sending --------------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        """To the scheduler, in order with everything sent before."""
        ipc.send(self._to_scheduler, msg)

    def send_abort(self, msg: AbortReq) -> None:
        """To every process that may hold the rid's state: the scheduler and the detokenizer."""
        msg.reply_to = self.reply_to
        ipc.send(self._to_scheduler, msg)
        if self._to_detokenizer is not None:
            ipc.send(self._to_detokenizer, msg)

    async def control(self, msg: Any, reply_type: type) -> Any:
        """Send `msg` and wait for its `reply_type` reply (which comes back here: `msg` carries
        this worker's address); 503 after CONTROL_TIMEOUT_S."""
        self.check_healthy()
        msg.reply_to = self.reply_to
        waiters = self._waiters[reply_type]
        fut = asyncio.get_running_loop().create_future()
        # sent first: a message that fails to encode leaves no waiter to take another's reply
        self.send(msg)
        waiters.append(fut)
        try:
            return await asyncio.wait_for(fut, CONTROL_TIMEOUT_S)
        except TimeoutError:
            raise unavailable_error(
                f"the scheduler did not answer in {CONTROL_TIMEOUT_S:.0f} s"
            ) from None

    # ---- receiving ------------------------------------------------------------------------

    def _drain(self) -> None:
        """The socket's waiting messages, up to DRAIN_MAX (then the loop's other callbacks run
        before the rest). zmq's descriptor signals only a change, so it is read until empty:
        a recv that finds nothing leaves it armed for the next message."""
        if self._loop is None:
            return
        for _ in range(DRAIN_MAX):
            try:
                data = self._recv_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_scheduler_contact = time.monotonic()
            try:
                self._dispatch(INBOX.decode(data))
            except Exception:  # this loop must outlive any one bad message
                logger.exception("failed to handle a message from the %s", self._peer)
        self._loop.call_soon(self._drain)

    def _dispatch(self, msg: ToHttp) -> None:
        match msg:
            case BatchStrOutput() | BatchEmbeddingOutput():
                handler = self._handlers.get(type(msg))
                if handler is None:
                    logger.error("dropped a %s: nothing here takes it", type(msg).__name__)
                else:
                    handler(msg)
            case InternalStateReply() | FlushCacheReply() | OpenSessionReply():
                _resolve_first(self._waiters.get(type(msg)), msg)
            case SchedulerHeartbeat():
                self.heartbeat_seen = True  # its arrival is the news


class OwnsClient:
    """The health of a ModelClient's owner (a manager, or the main model standing for one), as
    the HTTP layer reads it: its `client`'s."""

    client: ModelClient

    @property
    def is_healthy(self) -> bool:
        return self.client.is_healthy

    @is_healthy.setter
    def is_healthy(self, value: bool) -> None:
        self.client.is_healthy = value

    @property
    def last_scheduler_contact(self) -> float:
        return self.client.last_scheduler_contact

    @property
    def heartbeat_seen(self) -> bool:
        return self.client.heartbeat_seen


def _resolve_first(waiters: deque[asyncio.Future[Any]] | None, reply: Any) -> None:
    if not waiters:
        logger.warning("dropped an unexpected %s", type(reply).__name__)
        return
    fut = waiters.popleft()
    if not fut.done():  # a caller that timed out leaves its done future in line
        fut.set_result(reply)


def unavailable_error(message: str, code: str = "service_unavailable") -> RequestError:
    return RequestError(message, status_code=503, code=code)


def shutting_down_error(counters: RequestCounters) -> RequestError:
    """The 503 of a call refused because the server is shutting down, counted in `counters`."""
    counters.rejected["shutting_down"] += 1
    return unavailable_error("the server is shutting down", code="shutting_down")
