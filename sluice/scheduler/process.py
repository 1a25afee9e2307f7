"""The scheduler process: owns the model and the Scheduler, driven by messages over ZMQ.

Loop guarantee: while the scheduler has work, pending messages are taken without blocking
between steps, so a new request or an abort waits at most one forward step; while idle or paused
(/pause_generation: steps end aborted and expired requests, no forward runs), the loop blocks on
the socket (IDLE_POLL_MS at a time). Every step's outputs go to the detokenizer: the
BatchTokenIDOutput of generation requests, then the BatchEmbeddingOutput of the pooled
(embedding / scoring) requests that finished, which the detokenizer passes on unchanged.
A message that cannot be taken in ends only the request it carries (an abort finish for its
rid, 400 if it could not be decoded, 500 if intake failed); an error inside `step()` ends the
process, and the launcher's watchdog notices. A SchedulerHeartbeat goes out at least every
heartbeat interval (busy or idle), so the HTTP process can tell a stuck loop; SIGTERM exits 0.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

from sluice.config import ServerArgs
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    CloseSessionReq,
    FinishReason,
    FlushCacheReply,
    FlushCacheReq,
    GetInternalStateReq,
    InternalStateReply,
    OpenSessionReq,
    SamplingParams,
    SchedulerHeartbeat,
    SetPausedReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from sluice.utils import ipc

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 200
PROCESS_TITLE = "sluice::scheduler"


def run_scheduler_process(args: ServerArgs, addrs: ipc.IpcAddrs, ready_conn: Any) -> None:
    """Entry point of the spawned process: build, report ready (or the error), then loop.
    An encoder model (embeddings, cross-encoder) gets the EncoderScheduler's loop instead."""
    from sluice.model.encoder_config import is_encoder_model

    if is_encoder_model(args.model_path):
        from sluice.scheduler.encoder_process import run_encoder_process

        return run_encoder_process(args, addrs, ready_conn)
    ipc.run_child(PROCESS_TITLE, args.log_level, ready_conn, lambda: SchedulerLoop(args, addrs))


class SchedulerLoop:
    def __init__(self, args: ServerArgs, addrs: ipc.IpcAddrs) -> None:
        import torch

        from sluice.model.loader import load_model_config
        from sluice.scheduler.resources import resolve_resources
        from sluice.scheduler.scheduler import Scheduler
        from sluice.utils.tokenizer import get_tokenizer

        self.cfg = load_model_config(args.model_path)
        self.res = resolve_resources(args, self.cfg)
        torch.set_num_threads(self.res.num_threads)
        self.scheduler = Scheduler(args, self.cfg, get_tokenizer(self.cfg.hf_dir), self.res)
        self.ctx = zmq.Context()
        self.recv_sock = ipc.pull_socket(self.ctx, addrs.scheduler_in)
        self.send_sock = ipc.push_socket(self.ctx, addrs.detokenizer_in)
        self.heartbeat = ipc.HeartbeatTimer(args.health_timeout)

    def info(self) -> dict[str, int | float | str]:
        res = self.res
        return {
            "model_name": self.cfg.model_name, "hf_dir": self.cfg.hf_dir,
            "context_len": res.context_len, "max_total_tokens": res.max_total_tokens,
            "max_running_requests": res.max_running_requests, "num_threads": res.num_threads,
            "device": str(res.device), "dtype": str(res.dtype).removeprefix("torch."),
            "vocab_size": self.cfg.vocab_size,
        }  # fmt: skip

    def run_forever(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        # idle means no live request, hence no deadline to wake up for
        busy = self.scheduler.has_work() and not self.scheduler.paused
        timeout = 0 if busy else IDLE_POLL_MS
        for frames in ipc.recv_all(self.recv_sock, timeout):
            self._handle(frames)
        if self.scheduler.has_work():
            for out in (self.scheduler.step(), self.scheduler.take_embedding_output()):
                if out is not None:
                    ipc.send(self.send_sock, out)
        self.scheduler.expire_sessions()  # about once a second, busy or idle
        if self.heartbeat.due():
            s = self.scheduler
            beat = SchedulerHeartbeat(len(s.running) + (s.chunked_req is not None), len(s.waiting))
            ipc.send(self.send_sock, beat)

    def _handle(self, frames: list[bytes]) -> None:
        try:
            msg = ipc.decode(frames)
        except ValueError as e:
            logger.error("dropped a message: %s", e)
            self._reject_undecodable(frames, str(e))
            return
        if isinstance(msg, TokenizedGenerateReqInput):
            self._add_request(msg)
        elif isinstance(msg, BatchTokenizedGenerateReqInput):
            for req in msg.reqs:
                self._add_request(req)
        elif isinstance(msg, TokenizedEmbeddingReqInput):
            self._add_embedding_request(msg)
        elif isinstance(msg, BatchTokenizedEmbeddingReqInput):
            for req in msg.reqs:
                self._add_embedding_request(req)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg)
        elif isinstance(msg, SetPausedReq):
            self.scheduler.set_paused(msg.paused)
        elif isinstance(msg, GetInternalStateReq):
            ipc.send(self.send_sock, InternalStateReply(self.scheduler.internal_state()))
        elif isinstance(msg, FlushCacheReq):
            ipc.send(self.send_sock, FlushCacheReply(self.scheduler.flush_cache()))
        elif isinstance(msg, OpenSessionReq):
            ipc.send(self.send_sock, self.scheduler.open_session(msg))
        elif isinstance(msg, CloseSessionReq):
            self.scheduler.close_session(msg)
        else:
            logger.error("dropped a message of unexpected type %s", type(msg).__name__)

    def _add_request(self, req: TokenizedGenerateReqInput) -> None:
        try:
            self.scheduler.add_request(req)
        except Exception as e:  # only this request fails; the scheduler state is untouched
            logger.exception("request %s could not be taken in", req.rid)
            ipc.send(self.send_sock, _abort_output(req, f"the scheduler rejected it: {e}"))

    def _add_embedding_request(self, req: TokenizedEmbeddingReqInput) -> None:
        try:
            self.scheduler.add_embedding_request(req)
        except Exception as e:  # only this request fails; the scheduler state is untouched
            logger.exception("request %s could not be taken in", req.rid)
            out = _embedding_abort_output(req.rid, req.reply_to, f"the scheduler rejected it: {e}")
            ipc.send(self.send_sock, out)

    def _reject_undecodable(self, frames: list[bytes], error: str) -> None:
        """A request that fails to decode still has a waiting client: end it (400) if its rid
        and reply address can be read at all, answering in the type its kind expects."""
        pooled = bytes(frames[0]) in EMBEDDING_REQ_TYPES if frames else False
        for rid, reply_to in _rids_of(frames):
            message = f"malformed request: {error}"
            if pooled:
                out = _embedding_abort_output(rid, reply_to, message, 400)
                ipc.send(self.send_sock, out)
                continue
            req = TokenizedGenerateReqInput(rid, [], SamplingParams(), reply_to=reply_to)
            ipc.send(self.send_sock, _abort_output(req, message, 400))


GENERATE_REQ_TYPES = (b"TokenizedGenerateReqInput", b"BatchTokenizedGenerateReqInput")
EMBEDDING_REQ_TYPES = (b"TokenizedEmbeddingReqInput", b"BatchTokenizedEmbeddingReqInput")


def _rids_of(frames: list[bytes]) -> list[tuple[str, str]]:
    """(rid, reply_to) of each request inside an undecodable request message, best effort."""
    if len(frames) != 2 or bytes(frames[0]) not in GENERATE_REQ_TYPES + EMBEDDING_REQ_TYPES:
        return []
    try:
        raw = msgspec.msgpack.decode(frames[1])
    except msgspec.DecodeError:
        return []
    items = raw.get("reqs", []) if isinstance(raw, dict) and "reqs" in raw else [raw]
    return [
        (it["rid"], str(it.get("reply_to", "")))
        for it in items
        if isinstance(it, dict) and isinstance(it.get("rid"), str)
    ]


def _abort_output(
    req: TokenizedGenerateReqInput, message: str, status_code: int = 500
) -> BatchTokenIDOutput:
    code = "invalid_request" if status_code == 400 else "internal_error"
    reason = FinishReason(type="abort", message=message, status_code=status_code, code=code)
    return BatchTokenIDOutput(
        rids=[req.rid], new_token_ids=[[]], finished_reasons=[reason],
        prompt_tokens=[len(req.input_ids)], completion_tokens=[0], cached_tokens=[0],
        skip_special_tokens=[True], spaces_between_special_tokens=[True], stop_strings=[[]],
        no_stop_trim=[False], output_token_logprobs=[[]], output_top_logprobs=[[]],
        input_token_logprobs=[[]], input_top_logprobs=[[]], reply_to=[req.reply_to],
    )  # fmt: skip


def _embedding_abort_output(
    rid: str, reply_to: str, message: str, status_code: int = 500
) -> BatchEmbeddingOutput:
    code = "invalid_request" if status_code == 400 else "internal_error"
    reason = FinishReason(type="abort", message=message, status_code=status_code, code=code)
    return BatchEmbeddingOutput(
        rids=[rid], embeddings=[b""], prompt_tokens=[0], finished_reasons=[reason],
        reply_to=[reply_to], cached_tokens=[0],
    )  # fmt: skip
