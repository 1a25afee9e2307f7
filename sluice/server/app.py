"""The FastAPI app of the HTTP process: routes, auth, metrics and error bodies.

`create_app(tokenizer_manager, server_args)` builds one app around one TokenizerManager. The
OpenAI routes and /generate delegate to the serving classes; the rest are small and live here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice import __version__
from sluice.server.errors import APIError, error_response, install_error_handlers
from sluice.server.logprobs import TokenText
from sluice.server.metrics import METRICS_CONTENT_TYPE, RequestCountMiddleware, ServerMetrics
from sluice.server.protocol import AbortRequest, DetokenizeRequest, TokenizeRequest
from sluice.server.serving_base import ServingContext, parse_body
from sluice.server.serving_chat import OpenAIServingChat
from sluice.server.serving_completions import OpenAIServingCompletion
from sluice.server.serving_generate import ServingGenerate

logger = logging.getLogger(__name__)

# paths that never ask for the API key
OPEN_PATHS = frozenset({"/health", "/metrics"})
STATE_TIMEOUT_S = 5.0
# a scheduler with work that has not stepped for this long is stuck
HEARTBEAT_MAX_AGE_S = 30.0


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <api_key>` (every path except OPEN_PATHS)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'"
                response = error_response(APIError(401, message, "invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    tokenizer_manager: Any, server_args: Any, *, keepalive_interval: float = 5.0
) -> FastAPI:
    app = FastAPI(title="sluice", version=__version__, docs_url=None, redoc_url=None)
    model_name = getattr(server_args, "served_model_name", None) or tokenizer_manager.model_name
    ctx = ServingContext(
        tokenizer_manager=tokenizer_manager,
        model_name=model_name,
        metrics=ServerMetrics(),
        token_text=TokenText(tokenizer_manager.tokenizer),
        keepalive_interval=keepalive_interval,
    )
    app.state.ctx = ctx
    app.state.server_args = server_args
    app.state.created = int(time.time())
    install_error_handlers(app)
    _add_generation_routes(app, ctx)
    _add_info_routes(app, ctx, server_args)
    _add_admin_routes(app, ctx)
    routes = {getattr(r, "path", "") for r in app.routes}
    if getattr(server_args, "api_key", None):
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key)
    app.add_middleware(RequestCountMiddleware, metrics=ctx.metrics, routes=routes)
    return app


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    chat, completion, generate = (
        OpenAIServingChat(ctx),
        OpenAIServingCompletion(ctx),
        ServingGenerate(ctx),
    )
    app.add_api_route("/v1/chat/completions", chat.handle, methods=["POST"])
    app.add_api_route("/v1/completions", completion.handle, methods=["POST"])
    app.add_api_route("/generate", generate.handle, methods=["POST", "PUT"])


async def _internal_state(ctx: ServingContext) -> dict[str, Any]:
    try:
        coro = ctx.tokenizer_manager.get_internal_state()
        return dict(await asyncio.wait_for(coro, STATE_TIMEOUT_S))
    except TimeoutError:
        raise APIError(503, "the scheduler did not answer in time", "server_unhealthy") from None


def _model_card(ctx: ServingContext, created: int) -> dict[str, Any]:
    context_len = int(ctx.tokenizer_manager.context_len)
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": created,
        "owned_by": "sluice",
        "root": ctx.model_name,
        "context_length": context_len,
        "max_model_len": context_len,
    }


def _public_args(server_args: Any) -> dict[str, Any]:
    args = dataclasses.asdict(server_args) if dataclasses.is_dataclass(server_args) else {}
    if args.get("api_key"):
        args["api_key"] = "***"
    return args


def _add_info_routes(app: FastAPI, ctx: ServingContext, server_args: Any) -> None:
    tm = ctx.tokenizer_manager

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(ctx, app.state.created)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        ctx.check_model(model)
        return _model_card(ctx, app.state.created)

    @app.get("/health")
    async def health() -> Response:
        ctx.check_ready()
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        ctx.check_ready()
        state = await _internal_state(ctx)
        busy = state.get("num_running_reqs", 0) + state.get("num_waiting_reqs", 0) > 0
        age = time.monotonic() - float(state.get("last_heartbeat", 0.0))
        if busy and age > HEARTBEAT_MAX_AGE_S:
            raise APIError(
                503, f"the scheduler has not stepped for {age:.0f} s", "server_unhealthy"
            )
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        cfg = tm.model_config
        return {
            "model_path": getattr(cfg, "source_path", None),
            "tokenizer_path": getattr(cfg, "hf_dir", None),
            "served_model_name": ctx.model_name,
            "architecture": getattr(cfg, "architecture", None),
            "context_length": int(tm.context_len),
            "vocab_size": getattr(cfg, "vocab_size", None),
            "is_generation": True,
        }

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        state = await _internal_state(ctx)
        return {**_public_args(server_args), "version": __version__, "internal_state": state}

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            state = await _internal_state(ctx)
        except APIError:
            state = None  # counters and histograms are still worth a scrape
        return Response(ctx.metrics.render(state), media_type=METRICS_CONTENT_TYPE)


def _add_admin_routes(app: FastAPI, ctx: ServingContext) -> None:
    tm = ctx.tokenizer_manager

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, TokenizeRequest)
        ctx.check_model(req.model)
        text = req.prompt if req.prompt is not None else req.text
        ids = await tm.tokenize(text or "", add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": int(tm.context_len)}

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, DetokenizeRequest)
        ctx.check_model(req.model)
        return {"text": await tm.detokenize(req.tokens)}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if not await tm.flush_cache():
            raise APIError(400, "cache not flushed: requests are still running", "server_busy")
        return JSONResponse({"success": True, "message": "Cache flushed."})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        req = await parse_body(request, AbortRequest)
        await tm.abort_request(rid=req.rid, abort_all=req.abort_all)
        return {"success": True}
