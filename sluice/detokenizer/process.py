"""The detokenizer process: token-id batches from the scheduler become text batches for the
TokenizerManager. It loads only the tokenizer (no model, no compute threads).

Everything else arriving here is passed on in order: control replies of the scheduler (the
internal-state reply gets this process's state count added), so a reply never overtakes the
text of the outputs the scheduler sent before it. An AbortReq from the TokenizerManager drops
the rid's decode state (the scheduler's abort finish would drop it too). With several HTTP
workers, each output goes to its owner (`routing.Outbox`: a text batch is split by the owners
of its token-id batch, a reply goes to its `reply_to`, a heartbeat to every worker).
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import zmq

from sluice.aborts import internal_error
from sluice.messages import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    InternalStateReply,
    ReadyMsg,
    ToDetokenizer,
)
from sluice.utils import ipc
from sluice.utils.routing import Outbox

logger = logging.getLogger(__name__)

PROCESS_TITLE = "sluice::detokenizer"
WAKE_MS = 200
INBOX = ipc.Inbox(ToDetokenizer)


def run_detokenizer_process(
    hf_dir: str, log_level: str, addrs: ipc.IpcAddrs, ready_conn: Any
) -> None:
    # set before torch can be imported (transformers imports it): no compute thread pools here
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    ipc.setup_child_process(PROCESS_TITLE, log_level)
    try:
        loop = DetokenizerLoop(hf_dir, addrs)
    except BaseException:
        ipc.report_ready(ready_conn, ReadyMsg("detokenizer", error=traceback.format_exc()))
        raise SystemExit(1) from None
    ipc.exit_on_stop_signal()  # the launcher's stop: a clean exit, at once; before the handshake
    ipc.report_ready(ready_conn, ReadyMsg("detokenizer"))
    loop.run_forever()


class DetokenizerLoop:
    def __init__(self, hf_dir: str, addrs: ipc.IpcAddrs) -> None:
        from sluice.detokenizer.manager import DetokenizerManager
        from sluice.utils.tokenizer import get_tokenizer

        self.manager = DetokenizerManager.with_pieces(get_tokenizer(hf_dir))
        self.ctx = zmq.Context()
        self.recv_sock = ipc.pull_socket(self.ctx, addrs.detokenizer_in)
        self.outbox = Outbox(self.ctx, addrs.all_owners)

    def run_forever(self) -> None:
        """Never blocks for longer than WAKE_MS: a signal that the kernel hands to another
        thread (the launcher's stop) runs its Python handler only when this thread wakes."""
        while True:
            if self.recv_sock.poll(WAKE_MS):
                self.handle(self.recv_sock.recv())

    def handle(self, data: bytes) -> None:
        try:
            msg = INBOX.decode(data)
        except ValueError as e:
            logger.error("dropped a message: %s", e)
            return
        match msg:
            case BatchTokenIDOutput():
                self.outbox.send(self._detokenize(msg), owners=msg.reply_to)
            case AbortReq():
                self.manager.abort(msg.rid, msg.reply_to)
            case InternalStateReply():
                msg.num_detokenizer_states = self.manager.num_states()
                self.outbox.send(msg)
            case _:  # the rest of `PassedOn`: replies, heartbeats, pooled outputs
                self.outbox.send(msg)

    def _detokenize(self, out: BatchTokenIDOutput) -> BatchStrOutput:
        try:
            return self.manager.handle(out)
        except Exception as e:  # fail this batch's requests, keep serving the others
            logger.exception("detokenizing a batch of %d requests failed", len(out.rids))
            for rid, owner in zip(out.rids, out.reply_to, strict=True):
                self.manager.abort(rid, owner)
            return _failed_batch(out, f"detokenization failed: {e}")


def _failed_batch(out: BatchTokenIDOutput, message: str) -> BatchStrOutput:
    reason = internal_error(message)
    n = len(out.rids)
    return BatchStrOutput(
        rids=out.rids, texts=[""] * n, new_token_ids=out.new_token_ids,
        finished_reasons=[reason] * n, prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
        output_token_logprobs=out.output_token_logprobs,
        output_top_logprobs=out.output_top_logprobs,
        input_token_logprobs=out.input_token_logprobs, input_top_logprobs=out.input_top_logprobs,
    )  # fmt: skip
