"""POST /generate: SGLang's native API, so its clients work unchanged.

Non-streaming returns `{"text", "output_ids", "meta_info"}` (a list for a batch or n > 1).
Streaming sends `data: {...}` per update with the cumulative text, then `data: [DONE]`.
An aborted request ends with what it had and `meta_info.finish_reason` of type "abort" (with
its `status_code`, `code` and `message`): as the last streamed update, or, non-streaming, as the
body of a 200 when the client asked for the abort (499, /abort_request); an abort the server
decided (timeout 503, invalid 400, internal error 500, shutdown 503) is that error status with
an OpenAI error body instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sluice.server.errors import error_frame, error_response
from sluice.server.protocol import GenerateRequest
from sluice.server.serving_base import (
    CLIENT_CLOSED,
    OutputStream,
    ServingContext,
    finish_reason,
    make_usage,
    new_rid,
    parse_body,
    prime_until_disconnect,
    run_until_disconnect,
)
from sluice.server.sse import DONE_FRAME, KEEPALIVE_FRAME, SSEResponse, sse_data
from sluice.tokenizer.generate_input import GenerateReqInput

_LOGPROB_KEYS = (
    "output_token_logprobs",
    "output_top_logprobs",
    "input_token_logprobs",
    "input_top_logprobs",
)


def _num_samples(params: dict[str, Any] | list[dict[str, Any]] | None) -> int:
    first = params[0] if isinstance(params, list) and params else params
    return int((first or {}).get("n") or 1) if isinstance(first, dict) else 1


class ServingGenerate:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def convert(self, req: GenerateRequest) -> GenerateReqInput:
        return GenerateReqInput(
            text=req.text,
            input_ids=req.input_ids,
            sampling_params=req.sampling_params or {},
            rid=req.rid or new_rid(),
            return_logprob=req.return_logprob,
            logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num,
            stream=req.stream,
            session_params=req.session_params,
            timeout=req.timeout or 0.0,
            image_data=req.image_data,
        )

    async def handle(self, raw_request: Request) -> Response:
        stream: OutputStream | None = None
        try:
            req = await parse_body(raw_request, GenerateRequest)
            self.ctx.check_ready()
            obj = self.convert(req)
            is_list = not obj.is_single or _num_samples(obj.sampling_params) > 1
            tick = self.ctx.keepalive_interval if obj.stream else None
            stream = OutputStream(self.ctx.tokenizer_manager.generate_request(obj, tick))
            if obj.stream:
                if not await prime_until_disconnect(raw_request, stream):
                    await stream.aclose()
                    return Response(status_code=CLIENT_CLOSED)
                rejected = stream.rejected()  # e.g. a grammar that does not compile: its 4xx
                if rejected is not None:
                    raise rejected
                n = _num_samples(obj.sampling_params)
                body = self._sse_body(stream, obj.return_logprob, is_list, n)
                return SSEResponse(body, on_close=stream.aclose)
            work = self._collect(stream, obj, is_list)
            return await run_until_disconnect(raw_request, work)
        except Exception as exc:
            if stream is not None:
                await stream.aclose()
            return error_response(exc)

    @staticmethod
    def _output(item: dict[str, Any], with_logprobs: bool, with_index: bool) -> dict[str, Any]:
        meta = dict(item["meta_info"])
        if not with_logprobs:
            for key in _LOGPROB_KEYS:
                meta.pop(key, None)
        out = {"text": item["text"], "output_ids": list(item["output_ids"]), "meta_info": meta}
        if with_index:
            out["index"] = item["index"]
        return out

    async def _sse_body(
        self, stream: OutputStream, with_logprobs: bool, is_list: bool, n: int
    ) -> AsyncIterator[str]:
        tracker = self.ctx.metrics.track()
        metas: dict[int, dict[str, Any]] = {}
        try:
            async for item in stream.items():
                if item is None:
                    yield KEEPALIVE_FRAME
                    continue
                tracker.on_output(item)
                metas[item["index"]] = item["meta_info"]
                yield sse_data(self._output(item, with_logprobs, is_list))
            tracker.on_finish(make_usage(metas, n))
        except Exception as exc:
            yield error_frame(exc)
        yield DONE_FRAME

    async def _collect(
        self, stream: OutputStream, obj: GenerateReqInput, is_list: bool
    ) -> Response:
        finals: dict[int, dict[str, Any]] = {}
        tracker = self.ctx.metrics.track()
        try:
            async for item in stream.items():
                if item is not None:
                    finals[item["index"]] = item
        finally:
            await stream.aclose()
        items = [finals[i] for i in sorted(finals)]
        for item in items:
            reason = item["meta_info"].get("finish_reason") or {}
            if reason.get("status_code") != CLIENT_CLOSED:
                finish_reason(item["meta_info"])  # raises on a server-decided abort
        metas = {i: f["meta_info"] for i, f in finals.items()}
        tracker.on_finish(make_usage(metas, _num_samples(obj.sampling_params)))
        outputs = [self._output(item, obj.return_logprob, False) for item in items]
        return JSONResponse(outputs if is_list else outputs[0])
