"""The finish reasons of requests that end early, in one place: every process builds its aborts
(status, code, message: the error the client gets) through these."""

from __future__ import annotations

from sluice.messages import FinishReason

ABORTED_MESSAGE = "the request was aborted"
SHUTDOWN_MESSAGE = (
    "the server is shutting down and the request did not finish within the shutdown timeout"
)


def abort(status_code: int, code: str, message: str, matched: str | None = None) -> FinishReason:
    return FinishReason(
        type="abort", message=message, status_code=status_code, code=code, matched=matched
    )


def aborted() -> FinishReason:
    """By the client: a disconnect, /abort_request, abort_all (499, nginx's "client closed")."""
    return abort(499, "request_aborted", ABORTED_MESSAGE)


def invalid(message: str, code: str = "invalid_request") -> FinishReason:
    return abort(400, code, message)


def internal_error(message: str) -> FinishReason:
    return abort(500, "internal_error", message)


def unavailable(message: str, code: str = "service_unavailable") -> FinishReason:
    return abort(503, code, message)


def shutdown(message: str = SHUTDOWN_MESSAGE) -> FinishReason:
    """The SIGTERM drain ran out of time."""
    return unavailable(message, "shutdown")
