"""Server-sent events: framing, keep-alive, and a response that always closes its generator.

`SSEResponse` guarantees that its body generator is closed (`aclose`) and `on_close` awaited
when the stream ends for any reason, client disconnect included, so the TokenizerManager's
generator below it is closed too and the request is aborted promptly, not at garbage collection.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from json.encoder import encode_basestring  # what json.dumps(str, ensure_ascii=False) calls
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_FRAME = "data: [DONE]\n\n"
KEEPALIVE_FRAME = ": keep-alive\n\n"


def sse_data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# stands for the text in a FrameTemplate's body: noncharacters, which no text is meant to hold
_SLOT = "\ufdd0sluice-text\ufdd1"
_SLOT_JSON = encode_basestring(_SLOT)


class FrameTemplate:
    """The frames of chunks that differ only in one text field (a stream's text or content
    deltas): `frame(text)` is `sse_data(make_body(text))`, byte for byte, built as head + the
    JSON string of `text` + tail, serialized once. Should the head hold the slot's marker
    itself (a client's rid could), every frame takes `sse_data` instead."""

    def __init__(self, make_body: Callable[[str], Any]) -> None:
        self._make_body = make_body
        parts = sse_data(make_body(_SLOT)).split(_SLOT_JSON)
        self._parts = (parts[0], parts[1]) if len(parts) == 2 else None

    def frame(self, text: str) -> str:
        if self._parts is None:
            return sse_data(self._make_body(text))
        return self._parts[0] + encode_basestring(text) + self._parts[1]


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        super().__init__(content, headers=SSE_HEADERS, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream_then_stop() -> None:
            await self.stream_response(send)
            tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                if self.on_close is not None:
                    await self.on_close()
