"""The FastAPI app of the HTTP process: routes, auth, metrics and error bodies.

`create_app(tokenizer_manager, server_args)` builds one app around one MainModel. The
OpenAI routes and /generate delegate to the serving classes; the rest are small and live here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice import __version__
from sluice.server.chat_output import resolve_tool_parser
from sluice.server.errors import APIError, as_api_error, error_response, install_error_handlers
from sluice.server.logprobs import TokenText
from sluice.server.metrics import METRICS_CONTENT_TYPE, RequestCountMiddleware, ServerMetrics
from sluice.server.peers import Peers
from sluice.server.protocol import (
    AbortRequest,
    CloseSessionRequest,
    DetokenizeRequest,
    OpenSessionRequest,
    PauseGenerationRequest,
    TokenizeRequest,
)
from sluice.server.serving_base import ServingContext, parse_body
from sluice.server.serving_chat import OpenAIServingChat
from sluice.server.serving_completions import OpenAIServingCompletion
from sluice.server.serving_embedding import ServingEmbedding
from sluice.server.serving_generate import ServingGenerate
from sluice.server.serving_rerank import ServingRerank
from sluice.server.serving_score import ServingScore
from sluice.server.worker_info import identity, model_info, quiet_protocol_probes
from sluice.server.workers import WorkerGroup
from sluice.tokenizer.main_model import MainModel
from sluice.tokenizer.model_client import HeardFrom

logger = logging.getLogger(__name__)

# paths that never ask for the API key
OPEN_PATHS = frozenset({"/health", "/metrics"})
STATE_TIMEOUT_S = 5.0


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


def _no_telemetry() -> dict[str, Any]:
    """FastAPI's built-in OpenTelemetry hooks cost ~0.7 ms per request; /metrics covers us."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    off = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    return {"telemetry": off}


def create_app(
    tokenizer_manager: MainModel,
    server_args: Any,
    *,
    keepalive_interval: float = 5.0,
    embedders: list[Any] | None = None,
    peers: Peers | None = None,
) -> FastAPI:
    """`embedders`: the EmbeddingManagers of the server's encoder models, routed by `model`;
    the main model's own `embedding_manager` (a decoder's; None for an encoder) makes the chat
    model serve embeddings, /v1/score and rerank too. `peers`: this HTTP worker's line to the
    others (--tokenizer-worker-num > 1; `app.state.workers.handle` answers them), and every
    response then names the worker that served it in an `X-Sluice-Worker` header."""
    app = FastAPI(
        title="sluice", version=__version__, docs_url=None, redoc_url=None, **_no_telemetry()
    )
    model_name = getattr(server_args, "served_model_name", None) or tokenizer_manager.model_name
    ctx = ServingContext(
        tokenizer_manager=tokenizer_manager,
        model_name=model_name,
        metrics=ServerMetrics(),
        token_text=TokenText(tokenizer_manager.tokenizer),
        keepalive_interval=keepalive_interval,
        other_models=[e.model_name for e in embedders or []],
        tool_parser=resolve_tool_parser(
            getattr(server_args, "tool_call_parser", "auto"),
            getattr(tokenizer_manager.tokenizer, "chat_template", None),
        ),
        reasoning_parser=getattr(server_args, "reasoning_parser", None),
    )
    app.state.ctx = ctx
    app.state.server_args = server_args
    app.state.created = int(time.time())
    app.state.workers = WorkerGroup(tokenizer_manager, list(embedders or []), ctx.metrics, peers)
    counters = _request_counters(tokenizer_manager, list(embedders or []))
    if counters:
        ctx.metrics.watch_counters(*(c.as_dict for c in counters))
    install_error_handlers(app)
    quiet_protocol_probes()
    _add_generation_routes(app, ctx)
    _add_encoder_routes(app, ctx, list(embedders or []))
    _add_info_routes(app, ctx, server_args)
    _add_admin_routes(app, ctx)
    routes = {getattr(r, "path", "") for r in app.routes}
    if getattr(server_args, "api_key", None):
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key)
    app.add_middleware(RequestCountMiddleware, metrics=ctx.metrics, routes=routes)
    if peers is not None:
        app.add_middleware(WorkerHeaderMiddleware, index=peers.index)
    return app


class WorkerHeaderMiddleware:
    """`X-Sluice-Worker: <index>` on every response of this HTTP worker."""

    def __init__(self, app: ASGIApp, index: int) -> None:
        self.app = app
        self.header = (b"x-sluice-worker", str(index).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def _request_counters(tokenizer_manager: MainModel, embedders: list[Any]) -> list[Any]:
    """Every RequestCounters of the server, each once: the generation requests' and the pooled
    requests' of every model (an encoder main model's manager is also among `embedders`)."""
    decoder = tokenizer_manager.embedding_manager
    pooled = [*([decoder] if decoder is not None else []), *embedders]
    found: dict[int, Any] = {}
    for counters in (tokenizer_manager.counters, *(m.counters for m in pooled)):
        if counters is not None:
            found.setdefault(id(counters), counters)
    return list(found.values())


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    chat, completion, generate = (
        OpenAIServingChat(ctx),
        OpenAIServingCompletion(ctx),
        ServingGenerate(ctx),
    )
    app.add_api_route("/v1/chat/completions", chat.handle, methods=["POST"])
    app.add_api_route("/v1/completions", completion.handle, methods=["POST"])
    app.add_api_route("/generate", generate.handle, methods=["POST", "PUT"])


def _add_encoder_routes(app: FastAPI, ctx: ServingContext, embedders: list[Any]) -> None:
    app.state.embedders = embedders
    decoder = ctx.tokenizer_manager.embedding_manager
    models = [*embedders, *([decoder] if decoder is not None else [])]
    embedding, rerank = ServingEmbedding(ctx, models), ServingRerank(ctx, models)
    app.add_api_route("/v1/embeddings", embedding.handle, methods=["POST"])
    app.add_api_route("/v1/rerank", rerank.handle, methods=["POST"])
    app.add_api_route("/rerank", rerank.handle, methods=["POST"])
    app.add_api_route("/v1/score", ServingScore(ctx, models).handle, methods=["POST"])


def _encoder_card(embedder: Any, created: int) -> dict[str, Any]:
    return {
        "id": embedder.model_name, "object": "model", "created": created, "owned_by": "sluice",
        "root": embedder.model_name, "context_length": embedder.context_len,
        "max_model_len": embedder.context_len, "task": embedder.task,
        "dimensions": embedder.dimensions,
    }  # fmt: skip


async def _internal_state(ctx: ServingContext) -> dict[str, Any]:
    try:
        coro = ctx.tokenizer_manager.get_internal_state()
        return dict(await asyncio.wait_for(coro, STATE_TIMEOUT_S))
    except TimeoutError:
        raise APIError(503, "the scheduler did not answer in time", "server_unhealthy") from None


async def _encoder_states(encoders: list[Any]) -> dict[str, dict[str, Any]]:
    """The scheduler state of each encoder model, by model name, asked of all at once. Never
    raises: a model whose scheduler fails or does not answer within STATE_TIMEOUT_S is
    {"available": False, "error": why}; the others are their state with "available": True."""
    states = await asyncio.gather(*(_encoder_state(e) for e in encoders))
    return {e.model_name: state for e, state in zip(encoders, states, strict=True)}


async def _encoder_state(encoder: Any) -> dict[str, Any]:
    try:
        state = await asyncio.wait_for(encoder.get_internal_state(), STATE_TIMEOUT_S)
    except TimeoutError:
        why = f"the scheduler did not answer within {STATE_TIMEOUT_S:g} s"
        return {"available": False, "error": why}
    except Exception as exc:  # a dead child's 503, or anything else: reported, not raised
        return {"available": False, "error": str(getattr(exc, "message", None) or exc)}
    return {"available": True, **state}


def _model_card(ctx: ServingContext, created: int) -> dict[str, Any]:
    context_len = int(ctx.tokenizer_manager.context_len)
    decoder = ctx.tokenizer_manager.embedding_manager
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": created,
        "owned_by": "sluice",
        "root": ctx.model_name,
        "context_length": context_len,
        "max_model_len": context_len,
        "task": "generate",
        "tasks": list(decoder.tasks) if decoder is not None else ["generate"],
    }


def _silence(owner: HeardFrom) -> float:
    """Seconds since `owner`'s scheduler loop was last heard from; 0 until its first heartbeat
    (a loop that sends none is not judged)."""
    if not owner.heartbeat_seen:
        return 0.0
    return time.monotonic() - owner.last_scheduler_contact


def _public_args(server_args: Any) -> dict[str, Any]:
    args = dataclasses.asdict(server_args) if dataclasses.is_dataclass(server_args) else {}
    if args.get("api_key"):
        args["api_key"] = "***"
    return args


def _add_info_routes(app: FastAPI, ctx: ServingContext, server_args: Any) -> None:
    tm = ctx.tokenizer_manager

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        cards = [_encoder_card(e, app.state.created) for e in app.state.embedders]
        if tm.can_generate:
            cards.insert(0, _model_card(ctx, app.state.created))
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        for embedder in app.state.embedders:
            if embedder.model_name == model:
                return _encoder_card(embedder, app.state.created)
        ctx.check_model(model)
        return _model_card(ctx, app.state.created)

    health_timeout = float(getattr(server_args, "health_timeout", 20.0))

    @app.get("/health")
    async def health() -> Response:
        """Liveness: this process answers (never asks the scheduler, so it answers while the
        model works)."""
        ctx.check_ready()
        return Response(status_code=200)

    @app.get("/health_generate")
    @app.get("/ready")
    async def health_generate() -> Response:
        """Readiness: not shutting down, and every model's scheduler loop was heard from (an
        output or its heartbeat) within --health-timeout. Sends nothing to the schedulers."""
        ctx.check_ready()
        if tm.shutting_down:
            raise APIError(503, "the server is shutting down", "shutting_down")
        loops = [(ctx.model_name, tm), *((e.model_name, e) for e in app.state.embedders)]
        for name, owner in loops:
            age = _silence(owner)
            if age > health_timeout:
                raise APIError(
                    503, f"the scheduler of '{name}' has not been heard from for {age:.1f} s "
                    f"(--health-timeout {health_timeout:g} s)", "server_unhealthy",
                )  # fmt: skip
        return Response(status_code=200)

    # /model_info and /server_info are SGLang's newer names, which its gateway asks first
    info = model_info(tm, server_args, ctx.model_name)
    names = identity(tm, server_args, ctx.model_name)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> dict[str, Any]:
        return info

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        """The settings, with `model_path` and `served_model_name` resolved (never null);
        `internal_state`: the main model's processes (503 if its scheduler does not answer);
        `encoder_internal_states`: each other model's scheduler, by model name (never fails)."""
        main = tm.manager  # an encoder main model's manager answers as internal_state
        others = [e for e in app.state.embedders if e is not main]
        state, encoder_states = await asyncio.gather(_internal_state(ctx), _encoder_states(others))
        info = {
            **_public_args(server_args), **names, "version": __version__,
            "internal_state": state, "encoder_internal_states": encoder_states,
        }  # fmt: skip
        if app.state.workers.peers is not None:
            await _add_workers(info, app.state.workers)
        return info

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            state = await _internal_state(ctx)
        except APIError:
            state = None  # counters and histograms are still worth a scrape
        peers = await app.state.workers.peer_metrics()
        return Response(ctx.metrics.render(state, peers), media_type=METRICS_CONTENT_TYPE)


async def _add_workers(info: dict[str, Any], workers: WorkerGroup) -> None:
    """Every HTTP worker's request states counted in (`num_req_states` of the main model and
    of each encoder model), and `tokenizer_workers`: each worker's index, pid and states;
    `tokenizer_worker`: the index of the one that answered."""
    states = await workers.req_states()
    here = states[0]
    info["internal_state"]["num_req_states"] += sum(r.num_req_states for r in states[1:])
    for name, encoder_state in info["encoder_internal_states"].items():
        if "num_req_states" in encoder_state:
            encoder_state["num_req_states"] += sum(
                r.encoder_req_states.get(name, 0) for r in states[1:]
            )
    info["tokenizer_worker"] = here.worker
    info["tokenizer_workers"] = [
        {"index": r.worker, "pid": r.pid, "num_req_states": r.num_req_states}
        for r in sorted(states, key=lambda r: r.worker)
    ]


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
        """Idempotent: an unknown or finished rid is not an error (num_aborted is 0).
        `abort_all` also ends every pooled request (embeddings, scores, rerank) of every model
        with 499 "request_aborted"; num_aborted counts rids (one per input), and one for each
        pooled call whose inputs were still being tokenized."""
        req = await parse_body(request, AbortRequest)
        if req.abort_all:
            return {"success": True, "num_aborted": await abort_all_models()}
        return {"success": True, "num_aborted": await app.state.workers.abort(req.rid)}

    async def abort_all_models() -> int:
        """Every worker's requests, of every model."""
        return await app.state.workers.abort_all()

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        """Every model's scheduler stops running forward steps until /continue_generation;
        requests sent meanwhile queue. An empty body means SGLang's default, mode "abort"."""
        empty = not (await request.body()).strip()
        req = (
            PauseGenerationRequest() if empty else await parse_body(request, PauseGenerationRequest)
        )
        num = 0
        if req.mode == "abort":
            num = await abort_all_models()
        _set_paused(True)
        return {"success": True, "mode": req.mode, "num_aborted": num}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        _set_paused(False)
        return {"success": True}

    def _set_paused(paused: bool) -> None:
        tm.set_paused(paused)
        for encoder in app.state.embedders:
            encoder.set_paused(paused)

    @app.post("/open_session")
    async def open_session(request: Request) -> str:
        """Returns the session id as a JSON string (SGLang's reply)."""
        req = await parse_body(request, OpenSessionRequest)
        try:
            return await tm.open_session(
                req.session_id, req.timeout or 0.0, req.capacity_of_str_len or 0
            )
        except Exception as exc:  # the TokenizerManager's RequestError: an OpenAI error body
            raise as_api_error(exc) from None

    @app.post("/close_session")
    async def close_session(request: Request) -> dict[str, Any]:
        """Fire and forget: closing an unknown or closed session is not an error."""
        req = await parse_body(request, CloseSessionRequest)
        tm.close_session(req.session_id)
        return {"success": True}
