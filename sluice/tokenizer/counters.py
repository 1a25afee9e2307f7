"""Counters of the request path: how requests ended early.

The TokenizerManager keeps one for generation requests, and every EmbeddingManager one for its
pooled requests (embeddings, scores, rerank); /metrics exports their sum. Each early end of a rid
is counted exactly once, by its owner, at the place that decides it: a disconnect, /abort_request
or a shutdown abort where the owner ends the rid; a timeout, invalid input or internal error when
the scheduler's abort finish arrives for a live rid. `unknown_rid_outputs` counts outputs for an
rid the TokenizerManager neither holds nor awaits an abort echo for: zombies, which should never
happen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ABORT_CAUSES = (
    "client_disconnect", "abort_request", "shutdown", "timeout", "invalid", "internal_error",
)  # fmt: skip
TIMEOUT_KINDS = ("waiting", "running", "request")
REJECT_REASONS = ("queue_full", "shutting_down")


@dataclass
class RequestCounters:
    aborts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ABORT_CAUSES, 0))
    timeouts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIMEOUT_KINDS, 0))
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    unknown_rid_outputs: int = 0

    def count_abort(self, cause: str, num: int = 1) -> None:
        self.aborts[cause] = self.aborts.get(cause, 0) + num

    def count_finish(self, reason: dict[str, Any]) -> None:
        """Count a scheduler-side abort finish (`reason` as in meta_info["finish_reason"])."""
        if reason.get("type") != "abort":
            return
        code = reason.get("code")
        if code == "timeout":
            kind = str(reason.get("matched") or "request_timeout").removesuffix("_timeout")
            self.timeouts[kind] = self.timeouts.get(kind, 0) + 1
            self.count_abort("timeout")
        elif code == "shutdown":
            self.count_abort("shutdown")
        elif code == "request_aborted":
            self.count_abort("abort_request")
        elif reason.get("status_code") == 400:
            self.count_abort("invalid")
        else:
            self.count_abort("internal_error")

    def as_dict(self) -> dict[str, Any]:
        return {
            "aborts": dict(self.aborts),
            "timeouts": dict(self.timeouts),
            "rejected": dict(self.rejected),
            "unknown_rid_outputs": self.unknown_rid_outputs,
        }
