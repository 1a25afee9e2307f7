"""Graceful shutdown of the HTTP server on SIGTERM / Ctrl-C (installed by `launch_server` only;
a library user of the app gets no signal handlers).

First signal: readiness turns 503 and new requests get 503 (`begin_shutdown`); requests in
flight may finish for up to `--shutdown-timeout` seconds; whatever is still running then ends
with a 503 "shutdown" abort (streams get an error frame, then [DONE]); then uvicorn stops, which
waits for those last responses to be written. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

logger = logging.getLogger(__name__)

POLL_S = 0.05


class GracefulShutdown:
    def __init__(self, server: Any, tokenizer_manager: Any, timeout: float) -> None:
        self.server = server  # a uvicorn.Server
        self.tm = tokenizer_manager
        self.timeout = timeout
        self._drain: asyncio.Task[None] | None = None

    def on_signal(self, sig: int) -> None:
        if self._drain is None:
            logger.info(
                "%s: refusing new requests; draining %d in flight for up to %g s",
                signal.Signals(sig).name, len(self.tm.rid_to_state), self.timeout,
            )  # fmt: skip
            self._drain = asyncio.get_running_loop().create_task(self.drain())
            return
        logger.warning("%s again: stopping now", signal.Signals(sig).name)
        self.server.force_exit = True
        self.server.should_exit = True

    async def drain(self) -> None:
        self.tm.begin_shutdown()
        deadline = time.monotonic() + self.timeout
        while self.tm.rid_to_state and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if self.tm.rid_to_state:
            num = self.tm.abort_all_for_shutdown()
            logger.warning("shutdown timeout reached: aborted %d requests", num)
        self.server.should_exit = True
