"""What every generation route shares: body parsing, model check, the output stream of the
TokenizerManager, disconnect handling, finish reasons and usage.

`OpenAIServingBase.handle` is the whole request flow: parse → check model and readiness →
`convert` (the protocol ends there) → stream SSE frames or build one JSON response. Subclasses
supply `convert`, `stream_frames`, `final_response` and `usage_chunk`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from sluice.server.errors import APIError, error_frame, error_response, validation_error
from sluice.server.logprobs import TokenText
from sluice.server.metrics import RequestTracker, ServerMetrics
from sluice.server.sse import DONE_FRAME, KEEPALIVE_FRAME, FrameTemplate, SSEResponse, sse_data
from sluice.tokenizer.generate_input import GenerateReqInput

M = TypeVar("M", bound=BaseModel)

# status of a response nobody reads any more (nginx's "client closed request")
CLIENT_CLOSED = 499
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class ServingContext:
    """What the serving classes of one app share."""

    tokenizer_manager: Any
    model_name: str
    metrics: ServerMetrics
    token_text: TokenText
    keepalive_interval: float = 5.0
    other_models: list[str] = field(default_factory=list)  # encoder models: no generation
    tool_parser: str = "hermes"  # the family of tool calls the chat model writes
    reasoning_parser: str | None = None  # `<think>` format of the chat model's reasoning, if any

    def check_model(self, model: str | None) -> None:
        if model and model in self.other_models:
            raise APIError(
                400, f"the model '{model}' is an embedding/rerank model: it cannot generate",
                "invalid_request_error", "model",
            )  # fmt: skip
        if model and model != self.model_name:
            served = ", ".join(f"'{m}'" for m in [self.model_name, *self.other_models])
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves {served}.",
                "model_not_found",
                "model",
            )

    def check_ready(self) -> None:
        tm = self.tokenizer_manager
        if not tm.server_ready:
            raise APIError(503, "the server is starting", "server_not_ready")
        if not tm.is_healthy:
            raise APIError(503, "the server is unhealthy", "server_unhealthy")


async def parse_body(request: Request, model_cls: type[M]) -> M:
    """The JSON body as `model_cls`; malformed JSON or a wrong field is a 400. Strict JSON: UTF-8
    (json.loads alone would take UTF-16 and UTF-32 too), no NaN or Infinity, and text is Unicode
    (no lone surrogate escapes such as "\\ud800")."""
    data = decode_json(await request.body())
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", "invalid_request_error")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


_FAST_JSON = msgspec.json.Decoder()


def decode_json(body: bytes) -> Any:
    """`body` as JSON, or the 400 that says why not. msgspec's decoder takes strict JSON alone
    (UTF-8, no NaN or Infinity, no lone surrogate), about twice as fast as json on a large body
    (a 400 KB image); whatever it refuses goes through json.loads and the checks after it, so
    errors read as before and a number past the float range is still inf."""
    try:
        return _FAST_JSON.decode(body)
    except (msgspec.MsgspecError, RecursionError):
        pass
    try:
        text = body.decode("utf-8")
        data = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", "invalid_json") from None
    except ValueError as exc:  # UnicodeDecodeError (bytes that are not UTF-8) among them
        raise APIError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if "\\u" in text and _has_lone_surrogate(data):
        raise APIError(
            400, "request body is not valid JSON: a string holds a lone UTF-16 surrogate "
            "(an unpaired \\ud800-\\udfff escape)", "invalid_json",
        )  # fmt: skip
    return data


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def _has_lone_surrogate(data: Any) -> bool:
    """Whether any string (key or value) of parsed JSON `data` is not valid Unicode text."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class OutputStream:
    """The TokenizerManager's generator of one request. A stream's generator is made with its
    keep-alive `tick`, and yields None whenever tick seconds pass without an update (the
    manager's own timer: no task or wait_for per item).

    Owns the generator: `aclose` (idempotent) closes it, which is what makes the
    TokenizerManager abort the request.
    """

    def __init__(self, gen: AsyncIterator[dict[str, Any] | None]) -> None:
        self._gen = gen
        self._buffer: list[dict[str, Any]] = []
        self._exhausted = False

    async def prime(self) -> None:
        """Wait for the first item or tick; errors raised before it propagate here."""
        try:
            item = await anext(self._gen)
        except StopAsyncIteration:
            self._exhausted = True
            return
        if item is not None:
            self._buffer.append(item)

    def rejected(self) -> APIError | None:
        """The error of a request refused before it produced anything (its first item is a
        4xx abort, e.g. a grammar that does not compile), so a stream can still answer it with
        that status instead of a 200 and an error event."""
        if not self._buffer:
            return None
        reason = self._buffer[0]["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "abort" and 400 <= int(reason.get("status_code") or 0) < 499:
            try:
                finish_reason(self._buffer[0]["meta_info"])
            except APIError as err:
                return err
        return None

    async def items(self) -> AsyncIterator[dict[str, Any] | None]:
        """The items, and a None at each tick of a stream's generator."""
        while self._buffer:
            yield self._buffer.pop(0)
        if not self._exhausted:
            async for item in self._gen:
                yield item

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._gen.aclose()  # type: ignore[attr-defined]


async def run_until_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run `work`; cancel it if the client disconnects first (ASGI `http.disconnect`)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return Response(status_code=CLIENT_CLOSED)
    finally:
        with anyio.CancelScope(shield=True):
            for t in (task, watcher):
                t.cancel()
                with suppress(BaseException):
                    await t


async def prime_until_disconnect(request: Request, stream: OutputStream) -> bool:
    """`stream.prime()`, unless the client disconnects first (then False): a stream still
    queued or in prefill is aborted at once, not after the first keepalive."""
    primer = asyncio.ensure_future(stream.prime())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({primer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if primer.done():
            primer.result()  # errors raised before the first item propagate
            return True
        return False
    finally:
        with anyio.CancelScope(shield=True):
            for t in (primer, watcher):
                t.cancel()
                with suppress(BaseException):
                    await t


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def finish_reason(meta: dict[str, Any]) -> str | None:
    """OpenAI's finish_reason; an abort is not one: it raises the APIError it carries."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    if reason.get("type") == "abort":
        raise APIError(
            int(reason.get("status_code") or 503),
            reason.get("message") or "the request was aborted",
            reason.get("code") or "request_aborted",
        )
    return "length" if reason.get("type") == "length" else "stop"


def make_usage(metas: dict[int, dict[str, Any]], n: int) -> dict[str, Any]:
    """Prompt (and cached) tokens count once per prompt; completion tokens sum all choices."""
    firsts = [m for i, m in metas.items() if i % n == 0]
    prompt = sum(int(m.get("prompt_tokens") or 0) for m in firsts)
    cached = sum(int(m.get("cached_tokens") or 0) for m in firsts)
    completion = sum(int(m.get("completion_tokens") or 0) for m in metas.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class ResponseState:
    """One request's response being built: identity, options, and per-choice progress."""

    id: str
    model: str
    n: int
    stream: bool
    include_usage: bool
    tracker: RequestTracker
    created: int = field(default_factory=lambda: int(time.time()))
    metas: dict[int, dict[str, Any]] = field(default_factory=dict)  # index -> latest meta_info
    started: set[int] = field(default_factory=set)  # indexes that sent their first chunk
    extra: dict[str, Any] = field(default_factory=dict)  # route-specific (echo prompts, ...)
    # index -> the frame of its plain text chunks (a stream's most frequent frame)
    text_frames: dict[int, FrameTemplate] = field(default_factory=dict)

    def usage(self) -> dict[str, Any]:
        return make_usage(self.metas, self.n)

    def text_frame(self, index: int, text: str, make_body: Callable[[str], Any]) -> str:
        """`sse_data(make_body(text))` for the plain text chunks of choice `index`, from the
        frame serialized once for that choice (`FrameTemplate`)."""
        template = self.text_frames.get(index)
        if template is None:
            template = self.text_frames[index] = FrameTemplate(make_body)
        return template.frame(text)


def new_rid() -> str:
    return uuid.uuid4().hex


class OpenAIServingBase:
    request_model: type[BaseModel]
    id_prefix = ""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    @property
    def tm(self) -> Any:
        return self.ctx.tokenizer_manager

    async def handle(self, raw_request: Request) -> Response:
        stream: OutputStream | None = None
        try:
            req = await parse_body(raw_request, self.request_model)
            self.ctx.check_model(getattr(req, "model", None))
            self.ctx.check_ready()
            obj = await self.convert(req)
            state = self.new_state(req, obj)
            await self.prepare(req, state)
            tick = self.ctx.keepalive_interval if obj.stream else None
            stream = OutputStream(self.tm.generate_request(obj, tick))
            if obj.stream:
                if not await prime_until_disconnect(raw_request, stream):
                    await stream.aclose()
                    return Response(status_code=CLIENT_CLOSED)
                rejected = stream.rejected()
                if rejected is not None:
                    raise rejected
                return SSEResponse(self.sse_body(state, stream), on_close=stream.aclose)
            work = self.collect_response(state, stream)
            return await run_until_disconnect(raw_request, work)
        except Exception as exc:
            if stream is not None:
                await stream.aclose()
            return error_response(exc)

    async def convert(self, req: Any) -> GenerateReqInput:
        raise NotImplementedError

    async def prepare(self, req: Any, state: ResponseState) -> None:
        """Route-specific async set-up before generation starts (nothing by default)."""

    def new_state(self, req: Any, obj: GenerateReqInput) -> ResponseState:
        return ResponseState(
            id=f"{self.id_prefix}{obj.rid}",
            model=self.ctx.model_name,
            n=int(req.n),
            stream=bool(obj.stream),
            include_usage=bool(req.include_usage),
            tracker=self.ctx.metrics.track(),
        )

    async def sse_body(self, state: ResponseState, stream: OutputStream) -> AsyncIterator[str]:
        try:
            async for item in stream.items():
                if item is None:
                    yield KEEPALIVE_FRAME
                    continue
                state.tracker.on_output(item)
                state.metas[item["index"]] = item["meta_info"]
                for frame in self.stream_frames(state, item):
                    yield frame
            usage = state.usage()
            state.tracker.on_finish(usage)
            if state.include_usage:
                yield sse_data(self.usage_chunk(state, usage))
        except Exception as exc:
            yield error_frame(exc)
        yield DONE_FRAME

    async def collect_response(self, state: ResponseState, stream: OutputStream) -> Response:
        finals: dict[int, dict[str, Any]] = {}
        try:
            async for item in stream.items():
                if item is not None:
                    finals[item["index"]] = item
                    state.metas[item["index"]] = item["meta_info"]
        finally:
            await stream.aclose()
        ordered = [finals[i] for i in sorted(finals)]
        body = self.final_response(state, ordered)  # raises on an abort finish
        state.tracker.on_finish(body["usage"])
        return JSONResponse(body)

    def stream_frames(self, state: ResponseState, item: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def final_response(self, state: ResponseState, items: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, state: ResponseState, usage: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_head(self, state: ResponseState, obj: str) -> dict[str, Any]:
        return {"id": state.id, "object": obj, "created": state.created, "model": state.model}
