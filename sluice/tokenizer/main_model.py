"""MainModel: the server's main model as the HTTP layer uses it.

Two classes stand there: the TokenizerManager (a decoder: generation, and its pooled requests
through `embedding_manager`) and the EncoderFrontend (an encoder main model: no generation, its
requests go through its EncoderManager). The app reads these attributes directly; a class that
stands there declares every one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from sluice.tokenizer.counters import RequestCounters
from sluice.tokenizer.embedding_manager import EmbeddingManager, EncoderManager


class MainModel(Protocol):
    model_name: str
    context_len: int
    tokenizer: Any
    model_config: Any  # ModelConfig | EncoderConfig
    can_generate: bool  # False: every generation route is a 400
    # the decoder's pooled requests (embeddings, scores); None for an encoder main model
    embedding_manager: EmbeddingManager | None
    # an encoder main model's EncoderManager (also among the app's embedders); None for a decoder
    manager: EncoderManager | None
    counters: RequestCounters | None  # generation requests' early ends; None: no generation
    rid_to_state: dict[str, Any]  # live generation rids (the shutdown drain waits on them)
    server_ready: bool
    shutting_down: bool  # set by begin_shutdown

    # the main model's scheduler as this process sees it (ModelClient)
    @property
    def is_healthy(self) -> bool: ...
    @property
    def last_scheduler_contact(self) -> float: ...
    @property
    def heartbeat_seen(self) -> bool: ...

    def generate_request(
        self, obj: Any, tick: float | None = None
    ) -> AsyncIterator[dict[str, Any] | None]: ...
    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str: ...
    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    async def detokenize(self, ids: list[int]) -> str: ...
    async def get_internal_state(self) -> dict[str, Any]: ...
    def num_req_states(self) -> int: ...  # request states held in this process
    async def flush_cache(self) -> bool: ...
    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> int: ...
    async def open_session(self, *args: Any) -> str: ...
    def close_session(self, session_id: str) -> None: ...
    def set_paused(self, paused: bool) -> None: ...
    def begin_shutdown(self) -> None: ...
    def abort_all_for_shutdown(self) -> int: ...
    def on_child_death(self, message: str) -> None: ...
    async def close(self) -> None: ...
