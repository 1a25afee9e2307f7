"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a string code.

`APIError` is what the HTTP layer raises; `RequestError` (from the TokenizerManager) is mapped to
the same body. Every error that leaves the server goes through `error_response` or `error_frame`,
a route's own or the app's handlers: a route that lets a RequestError (or anything) escape still
answers with this body (its status, or a logged 500).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.tokenizer.normalize import RequestError

logger = logging.getLogger(__name__)

# the OpenAI `type` for each status
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers  # extra response headers (Retry-After of a 429)


def error_type(status_code: int) -> str:
    if status_code in _ERROR_TYPES:
        return _ERROR_TYPES[status_code]
    return "invalid_request_error" if status_code < 500 else "server_error"


def error_body(
    status_code: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    code = None if code is None else str(code)
    return {
        "error": {
            "message": message,
            "type": error_type(status_code),
            "param": param,
            "code": code,
        }
    }


def as_api_error(exc: BaseException) -> APIError:
    """APIError for anything raised while serving; unknown exceptions are 500 (logged)."""
    if isinstance(exc, APIError):
        return exc
    status = getattr(exc, "status_code", None)
    message = getattr(exc, "message", None)
    if isinstance(status, int) and isinstance(message, str):  # RequestError and friends
        return APIError(
            status, message, getattr(exc, "code", None), getattr(exc, "param", None),
            getattr(exc, "headers", None),
        )  # fmt: skip
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", "internal_error")


def error_response(exc: BaseException) -> JSONResponse:
    err = as_api_error(exc)
    headers = dict(err.headers or {})
    if err.status_code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(
        error_body(err.status_code, err.message, err.code, err.param),
        status_code=err.status_code,
        headers=headers,
    )


def error_frame(exc: BaseException) -> str:
    """The SSE frame of an error raised after the stream started (the caller sends [DONE])."""
    err = as_api_error(exc)
    body = error_body(err.status_code, err.message, err.code, err.param)
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """400 from pydantic's error list; `param` is the dotted location of the first error."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return APIError(400, message, "invalid_request_error", param)


def install_error_handlers(app: FastAPI) -> None:
    """Framework errors get OpenAI bodies: 422 becomes 400, unknown routes 404."""

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = "Not found: no such route"
        return error_response(APIError(exc.status_code, message, code))

    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(APIError, on_error)
    app.add_exception_handler(RequestError, on_error)
    app.add_exception_handler(Exception, on_error)  # anything else: a logged 500
