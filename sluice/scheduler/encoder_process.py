"""The scheduler process of an encoder model: an EncoderScheduler driven by messages over ZMQ.

Same loop guarantee as the decoder's `SchedulerLoop`: while there is work, messages are taken
without blocking between steps; while idle, the loop blocks on the socket. Each step's
BatchEmbeddingOutput goes to `addrs.detokenizer_in`, which is the detokenizer (it passes it on
unchanged) or, for an extra model of a server, the EmbeddingManager's own socket directly.
A SchedulerHeartbeat goes out at least every heartbeat interval, busy or idle, as from the
decoder's scheduler: the readiness check judges every model's loop the same way.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from sluice.config import ServerArgs
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    FinishReason,
    FlushCacheReply,
    FlushCacheReq,
    GetInternalStateReq,
    InternalStateReply,
    SchedulerHeartbeat,
    SetPausedReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from sluice.utils import ipc

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 200
PROCESS_TITLE = "sluice::encoder"


def run_encoder_process(args: ServerArgs, addrs: ipc.IpcAddrs, ready_conn: Any) -> None:
    """Entry point of the spawned process: build, report ready (or the error), then loop."""
    ipc.run_child(PROCESS_TITLE, args.log_level, ready_conn, lambda: EncoderLoop(args, addrs))


def encoder_context_len(args: ServerArgs, max_seq_len: int, max_positions: int) -> int:
    if args.context_length > max_positions:
        raise ValueError(
            f"--context-length {args.context_length} exceeds the model's {max_positions} positions"
        )
    return args.context_length or max_seq_len


class EncoderLoop:
    def __init__(self, args: ServerArgs, addrs: ipc.IpcAddrs) -> None:
        import torch

        from sluice.model.encoder_config import load_encoder_config
        from sluice.model.encoder_runner import EncoderRunner
        from sluice.model.runner import resolve_device, resolve_dtype
        from sluice.scheduler.encoder import EncoderScheduler
        from sluice.utils.system import available_cpus

        assert args.model_path is not None
        cfg = load_encoder_config(args.model_path)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        num_threads = args.num_threads or available_cpus()
        torch.set_num_threads(num_threads)
        context_len = encoder_context_len(args, cfg.max_seq_len, cfg.max_position_embeddings)
        runner = EncoderRunner(cfg, device, dtype)
        max_batch_reqs = args.max_running_requests or 256
        self.scheduler = EncoderScheduler(
            runner, cfg.vocab_size, context_len, args.max_prefill_tokens, max_batch_reqs,
            waiting_timeout=args.waiting_timeout, running_timeout=args.running_timeout,
        )  # fmt: skip
        self._info: dict[str, int | float | str] = {
            "model_name": cfg.model_name, "hf_dir": cfg.hf_dir, "context_len": context_len,
            "max_total_tokens": 0, "max_running_requests": max_batch_reqs,
            "num_threads": num_threads, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "vocab_size": cfg.vocab_size,
            "task": "rerank" if cfg.is_cross_encoder else "embed",
            "dimensions": runner.output_dim,
        }  # fmt: skip
        self.ctx = zmq.Context()
        self.recv_sock = ipc.pull_socket(self.ctx, addrs.scheduler_in)
        self.send_sock = ipc.push_socket(self.ctx, addrs.detokenizer_in)
        self.heartbeat = ipc.HeartbeatTimer(args.health_timeout)

    def info(self) -> dict[str, int | float | str]:
        return self._info

    def run_forever(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        busy = self.scheduler.has_work() and not self.scheduler.paused
        timeout = 0 if busy else IDLE_POLL_MS
        for frames in ipc.recv_all(self.recv_sock, timeout):
            self._handle(frames)
        if self.scheduler.has_work():
            out = self.scheduler.step()
            if out is not None:
                ipc.send(self.send_sock, out)
        if self.heartbeat.due():
            ipc.send(self.send_sock, SchedulerHeartbeat(0, len(self.scheduler.waiting)))

    def _handle(self, frames: list[bytes]) -> None:
        try:
            msg = ipc.decode(frames)
        except ValueError as e:
            logger.error("dropped a message: %s", e)
            return
        if isinstance(msg, TokenizedEmbeddingReqInput):
            self.scheduler.add_request(msg)
        elif isinstance(msg, BatchTokenizedEmbeddingReqInput):
            for req in msg.reqs:
                self.scheduler.add_request(req)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg)
        elif isinstance(msg, SetPausedReq):
            self.scheduler.set_paused(msg.paused)
        elif isinstance(msg, GetInternalStateReq):
            ipc.send(self.send_sock, InternalStateReply(self.scheduler.internal_state()))
        elif isinstance(msg, FlushCacheReq):
            ipc.send(self.send_sock, FlushCacheReply(self.scheduler.flush_cache()))
        elif isinstance(msg, TokenizedGenerateReqInput | BatchTokenizedGenerateReqInput):
            reqs = msg.reqs if isinstance(msg, BatchTokenizedGenerateReqInput) else [msg]
            ipc.send(self.send_sock, _cannot_generate(reqs))
        else:
            logger.error("dropped a message of unexpected type %s", type(msg).__name__)


def _cannot_generate(reqs: list[TokenizedGenerateReqInput]) -> BatchEmbeddingOutput:
    reason = FinishReason(
        type="abort", message="this model is an encoder: it embeds or scores, it cannot generate",
        status_code=400, code="invalid_request",
    )  # fmt: skip
    return BatchEmbeddingOutput(
        rids=[r.rid for r in reqs], embeddings=[b""] * len(reqs),
        prompt_tokens=[len(r.input_ids) for r in reqs], finished_reasons=[reason] * len(reqs),
        reply_to=[r.reply_to for r in reqs],
    )  # fmt: skip
