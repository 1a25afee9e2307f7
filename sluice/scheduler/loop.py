"""The loop of every model process, the decoder's scheduler and each encoder's alike.

Loop guarantee: while the model has work, pending messages are taken without blocking between
steps, so a new request or an abort waits at most one step; while idle or paused
(/pause_generation: steps end aborted and expired requests, no forward runs), the loop blocks on
the socket IDLE_POLL_MS at a time. Every step's outputs go to `addrs.detokenizer_in`, in order
(an encoder, which has no detokenizer, sends each to its owning HTTP worker: `routing.Outbox`);
a control reply carries its request's `reply_to`.
A SchedulerHeartbeat goes out at least every heartbeat interval, busy or idle, so the HTTP
process can tell a stuck loop.

A message that cannot be taken in ends only the requests it carries, each answered in the
output type its kind expects: 400 when it cannot be decoded (if its rids can be read at all),
500 when intake raised. A control message that raises is logged and still answered where its
caller waits for a reply (a failed flush or session open). Only an error inside `step()`, or in
building the internal state, ends the process, and the launcher's watchdog notices.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import msgspec
import zmq

from sluice.aborts import internal_error, invalid
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    FlushCacheReply,
    FlushCacheReq,
    GetInternalStateReq,
    InternalStateReply,
    ModelInfo,
    OpenSessionReply,
    OpenSessionReq,
    SamplingParams,
    SchedulerHeartbeat,
    SetPausedReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    ToScheduler,
)
from sluice.utils import ipc
from sluice.utils.routing import Outbox

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 200

Request = TokenizedGenerateReqInput | TokenizedEmbeddingReqInput
GENERATE_REQ_TYPES = ("TokenizedGenerateReqInput", "BatchTokenizedGenerateReqInput")
EMBEDDING_REQ_TYPES = ("TokenizedEmbeddingReqInput", "BatchTokenizedEmbeddingReqInput")
REQUEST_TYPES = GENERATE_REQ_TYPES + EMBEDDING_REQ_TYPES  # tags of the messages with requests
INBOX = ipc.Inbox(ToScheduler)


class ModelCore(Protocol):
    """One model's scheduler as the loop drives it."""

    def info(self) -> ModelInfo: ...
    def has_work(self) -> bool: ...
    def is_paused(self) -> bool: ...
    def step(self) -> list[Any]:
        """Run one step; its outputs, to send in order."""
        ...

    def take_request(self, req: Request) -> Any | None:
        """Take one request in; an output to send at once, or None."""
        ...

    def handle_control(self, msg: ToScheduler) -> Any | None:
        """Any other message; a reply to send, or None. Raises UnknownMessage for a type it
        does not take."""
        ...

    def heartbeat(self) -> SchedulerHeartbeat: ...
    def tick(self) -> None:
        """Housekeeping once per loop iteration, busy or idle (cheap)."""
        ...


class UnknownMessage(Exception):
    """A core's answer to a message type it does not take."""


class SchedulerCore:
    """What the cores of both model kinds share: a scheduler with `has_work`, `paused`,
    `set_paused`, `abort`, `internal_state` and `flush_cache`. A kind adds its own messages in
    `handle_own` and its housekeeping in `tick`."""

    def __init__(self, scheduler: Any, info: ModelInfo) -> None:
        self.scheduler = scheduler
        self._info = info

    def info(self) -> ModelInfo:
        return self._info

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def is_paused(self) -> bool:
        return self.scheduler.paused

    def handle_control(self, msg: ToScheduler) -> Any | None:
        s = self.scheduler
        match msg:
            case AbortReq():
                s.abort(msg)
            case SetPausedReq():
                s.set_paused(msg.paused)
            case GetInternalStateReq():
                return InternalStateReply(s.internal_state())
            case FlushCacheReq():
                return FlushCacheReply(s.flush_cache())
            case _:
                return self.handle_own(msg)
        return None

    def handle_own(self, msg: Any) -> Any | None:
        raise UnknownMessage(type(msg).__name__)

    def tick(self) -> None:
        pass


class ModelLoop:
    """`recv_sock` takes the model's messages; `outbox` carries its outputs and replies."""

    def __init__(
        self, core: ModelCore, recv_sock: Any, outbox: Any, heartbeat: ipc.HeartbeatTimer
    ) -> None:
        self.core, self.heartbeat = core, heartbeat
        self.recv_sock, self.outbox = recv_sock, outbox

    @classmethod
    def bind(cls, core: ModelCore, addrs: ipc.IpcAddrs, health_timeout: float) -> ModelLoop:
        """The loop on the process's own sockets (`addrs.scheduler_in` in, detokenizer_in out)."""
        ctx = zmq.Context()
        recv_sock = ipc.pull_socket(ctx, addrs.scheduler_in)
        targets = (addrs.detokenizer_in,) if addrs.has_detokenizer else addrs.all_owners
        return cls(core, recv_sock, Outbox(ctx, targets), ipc.HeartbeatTimer(health_timeout))

    def info(self) -> ModelInfo:
        return self.core.info()

    def run_forever(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        core = self.core
        busy = core.has_work() and not core.is_paused()
        for data in ipc.recv_all(self.recv_sock, 0 if busy else IDLE_POLL_MS):
            self._take(data)
        if core.has_work():
            for out in core.step():
                self.outbox.send(out)
        core.tick()
        if self.heartbeat.due():
            self.outbox.send(core.heartbeat())

    def _take(self, data: bytes) -> None:
        try:
            msg = INBOX.decode(data)
        except ValueError as e:
            logger.error("dropped a message: %s", e)
            for out in _undecodable_outputs(data, f"malformed request: {e}"):
                self.outbox.send(out)
            return
        match msg:
            case BatchTokenizedGenerateReqInput() | BatchTokenizedEmbeddingReqInput():
                for req in msg.reqs:
                    self._take_request(req)
            case TokenizedGenerateReqInput() | TokenizedEmbeddingReqInput():
                self._take_request(msg)
            case _:
                self._take_control(msg)

    def _take_request(self, req: Request) -> None:
        try:
            out = self.core.take_request(req)
        except Exception as e:  # only this request fails; the scheduler state is untouched
            logger.exception("request %s could not be taken in", req.rid)
            out = abort_output(req, f"the scheduler rejected it: {e}", 500)
        if out is not None:
            self.outbox.send(out)

    def _take_control(self, msg: ToScheduler) -> None:
        """A failing control message still gets its reply (its caller waits for one, in order);
        one whose reply cannot be made without the scheduler (internal state) ends the process."""
        try:
            reply = self.core.handle_control(msg)
        except UnknownMessage:
            logger.error("dropped a message of unexpected type %s", type(msg).__name__)
            return
        except Exception as e:
            if isinstance(msg, GetInternalStateReq):
                raise
            logger.exception("a %s failed", type(msg).__name__)
            reply = _failure_reply(msg, f"{type(e).__name__}: {e}")
        if reply is not None:
            reply.reply_to = getattr(msg, "reply_to", "")
            self.outbox.send(reply)


def abort_output(req: Request, message: str, status_code: int) -> Any:
    """The output that ends `req` at once with an abort, in the type its kind expects."""
    reason = invalid(message) if status_code == 400 else internal_error(message)
    if isinstance(req, TokenizedEmbeddingReqInput):
        return BatchEmbeddingOutput(
            rids=[req.rid], embeddings=[b""], prompt_tokens=[len(req.input_ids)],
            finished_reasons=[reason], reply_to=[req.reply_to], cached_tokens=[0],
        )  # fmt: skip
    return BatchTokenIDOutput(
        rids=[req.rid], new_token_ids=[[]], finished_reasons=[reason],
        prompt_tokens=[len(req.input_ids)], completion_tokens=[0], cached_tokens=[0],
        skip_special_tokens=[True], spaces_between_special_tokens=[True], stop_strings=[[]],
        no_stop_trim=[False], output_token_logprobs=[[]], output_top_logprobs=[[]],
        input_token_logprobs=[[]], input_top_logprobs=[[]], reply_to=[req.reply_to],
    )  # fmt: skip


def _failure_reply(msg: ToScheduler, error: str) -> Any | None:
    """The reply that says `msg` failed, for the messages that expect one."""
    match msg:
        case FlushCacheReq():
            return FlushCacheReply(False)
        case OpenSessionReq():
            return OpenSessionReply(msg.session_id, False, f"the scheduler failed: {error}")
    return None


def _undecodable_outputs(data: bytes, message: str) -> list[Any]:
    """A request that fails to decode still has a waiting client: a 400 for each request inside
    it whose rid and reply address can be read at all."""
    raw = _raw_request(data)
    if raw is None:
        return []
    pooled = raw["type"] in EMBEDDING_REQ_TYPES
    outs = []
    for rid, reply_to in _rids_of(raw):
        req: Request
        if pooled:
            req = TokenizedEmbeddingReqInput(rid=rid, input_ids=[], reply_to=reply_to)
        else:
            req = TokenizedGenerateReqInput(rid, [], SamplingParams(), reply_to=reply_to)
        outs.append(abort_output(req, message, 400))
    return outs


def _raw_request(data: bytes) -> dict[str, Any] | None:
    """The plain map of an undecodable message tagged as a request; None for anything else."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(raw, dict) or raw.get("type") not in REQUEST_TYPES:
        return None
    return raw


def _rids_of(raw: dict[str, Any]) -> list[tuple[str, str]]:
    """(rid, reply_to) of each request inside an undecodable request message, best effort."""
    items = raw["reqs"] if "reqs" in raw else [raw]
    if not isinstance(items, list):
        return []
    return [
        (it["rid"], str(it.get("reply_to", "")))
        for it in items
        if isinstance(it, dict) and isinstance(it.get("rid"), str)
    ]
