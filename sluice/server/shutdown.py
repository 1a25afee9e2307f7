"""Graceful shutdown of the HTTP server on SIGTERM / Ctrl-C (installed by `launch_server` only;
a library user of the app gets no signal handlers).

First signal: readiness turns 503 and new requests get 503 "shutting_down" on every model
(`begin_shutdown` of the TokenizerManager and of each encoder model's manager), and a paused
server continues (/pause_generation's hold ends); requests in flight, generation and pooled (embeddings, scores, rerank) alike, may finish for up to
`--shutdown-timeout` seconds; whatever is still running then ends with a 503 "shutdown" abort
(streams get an error frame, then [DONE]); then uvicorn stops, which waits for those last
responses to be written. A second signal stops at once.

Ownership: the TokenizerManager ends what it owns (its generation rids and its
`embedding_manager`'s pooled ones); this object only counts them, and ends the encoder models'.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

from sluice.aborts import SHUTDOWN_MESSAGE
from sluice.tokenizer.main_model import MainModel

logger = logging.getLogger(__name__)

POLL_S = 0.05


class GracefulShutdown:
    """`encoders`: the managers of the server's encoder models (EncoderManager), each with its
    own scheduler; the TokenizerManager's own `embedding_manager` is not one of them."""

    def __init__(
        self,
        server: Any,
        tokenizer_manager: MainModel,
        timeout: float,
        encoders: list[Any] | None = None,
    ) -> None:
        self.server = server  # a uvicorn.Server
        self.tm = tokenizer_manager
        self.timeout = timeout
        self.encoders = list(encoders or [])
        self._drain: asyncio.Task[None] | None = None

    def on_signal(self, sig: int) -> None:
        if self._drain is None:
            logger.info(
                "%s: refusing new requests; draining %d in flight for up to %g s",
                signal.Signals(sig).name, self.num_in_flight(), self.timeout,
            )  # fmt: skip
            self._drain = asyncio.get_running_loop().create_task(self.drain())
            return
        logger.warning("%s again: stopping now", signal.Signals(sig).name)
        self.server.force_exit = True
        self.server.should_exit = True

    def num_in_flight(self) -> int:
        """Generation rids plus pooled rids of every model (the main model's and encoders')."""
        own = self.tm.embedding_manager  # None: the main model is an encoder
        pooled = [m for m in (own, *self.encoders) if m is not None]
        return len(self.tm.rid_to_state) + sum(len(m.pending) for m in pooled)

    async def drain(self) -> None:
        """Whatever goes wrong in here, the server stops at the end."""
        try:
            self.tm.begin_shutdown()
            self.tm.set_paused(False)  # a paused server (/pause_generation) drains too
            for encoder in self.encoders:
                encoder.begin_shutdown()
                encoder.set_paused(False)
            deadline = time.monotonic() + self.timeout
            while self.num_in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
            if self.num_in_flight():
                num = self.abort_all()
                logger.warning("shutdown timeout reached: aborted %d requests", num)
        except Exception:
            logger.exception("the shutdown drain failed; stopping now")
        finally:
            self.server.should_exit = True

    def abort_all(self) -> int:
        num = self.tm.abort_all_for_shutdown()
        for encoder in self.encoders:
            num += encoder.abort_all(503, "shutdown", SHUTDOWN_MESSAGE, reason="shutdown")
        return num
