"""The scheduler process: owns the model and the Scheduler, driven by messages over ZMQ.

Loop guarantee: while the scheduler has work, pending messages are taken without blocking
between steps, so a new request or an abort waits at most one forward step; while idle, the loop
blocks on the socket (IDLE_POLL_MS at a time). Every step's output goes to the detokenizer.
A message that cannot be taken in ends only the request it carries (an abort finish for its
rid); an error inside `step()` ends the process, and the launcher's watchdog notices.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import zmq

from sluice.config import ServerArgs
from sluice.messages import (
    AbortReq,
    BatchTokenIDOutput,
    BatchTokenizedGenerateReqInput,
    FinishReason,
    FlushCacheReply,
    FlushCacheReq,
    GetInternalStateReq,
    InternalStateReply,
    ReadyMsg,
    TokenizedGenerateReqInput,
)
from sluice.utils import ipc

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 200
PROCESS_TITLE = "sluice::scheduler"


def run_scheduler_process(args: ServerArgs, addrs: ipc.IpcAddrs, ready_conn: Any) -> None:
    """Entry point of the spawned process: build, report ready (or the error), then loop."""
    ipc.setup_child_process(PROCESS_TITLE, args.log_level)
    try:
        loop = SchedulerLoop(args, addrs)
    except BaseException:
        ipc.report_ready(ready_conn, ReadyMsg("scheduler", error=traceback.format_exc()))
        raise SystemExit(1) from None
    ipc.report_ready(ready_conn, ReadyMsg("scheduler", info=loop.info()))
    loop.run_forever()


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
        timeout = 0 if self.scheduler.has_work() else IDLE_POLL_MS
        for frames in ipc.recv_all(self.recv_sock, timeout):
            self._handle(frames)
        if self.scheduler.has_work():
            out = self.scheduler.step()
            if out is not None:
                ipc.send(self.send_sock, out)

    def _handle(self, frames: list[bytes]) -> None:
        try:
            msg = ipc.decode(frames)
        except ValueError as e:
            logger.error("dropped a message: %s", e)
            return
        if isinstance(msg, TokenizedGenerateReqInput):
            self._add_request(msg)
        elif isinstance(msg, BatchTokenizedGenerateReqInput):
            for req in msg.reqs:
                self._add_request(req)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg)
        elif isinstance(msg, GetInternalStateReq):
            ipc.send(self.send_sock, InternalStateReply(self.scheduler.internal_state()))
        elif isinstance(msg, FlushCacheReq):
            ipc.send(self.send_sock, FlushCacheReply(self.scheduler.flush_cache()))
        else:
            logger.error("dropped a message of unexpected type %s", type(msg).__name__)

    def _add_request(self, req: TokenizedGenerateReqInput) -> None:
        try:
            self.scheduler.add_request(req)
        except Exception as e:  # only this request fails; the scheduler state is untouched
            logger.exception("request %s could not be taken in", req.rid)
            ipc.send(self.send_sock, _abort_output(req, f"the scheduler rejected it: {e}"))


def _abort_output(req: TokenizedGenerateReqInput, message: str) -> BatchTokenIDOutput:
    reason = FinishReason(type="abort", message=message, status_code=500, code="internal_error")
    return BatchTokenIDOutput(
        rids=[req.rid], new_token_ids=[[]], finished_reasons=[reason],
        prompt_tokens=[len(req.input_ids)], completion_tokens=[0], cached_tokens=[0],
        skip_special_tokens=[True], spaces_between_special_tokens=[True], stop_strings=[[]],
        no_stop_trim=[False], output_token_logprobs=[[]], output_top_logprobs=[[]],
        input_token_logprobs=[[]], input_top_logprobs=[[]], reply_to=[req.reply_to],
    )  # fmt: skip
