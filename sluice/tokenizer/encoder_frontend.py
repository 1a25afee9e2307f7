"""EncoderFrontend: the server's main model when `--model-path` is an encoder (BERT embedder or
cross-encoder), standing where the TokenizerManager stands for a decoder (both are a MainModel).

The encoder's requests go through its EncoderManager (which the app routes by `model` like any
other encoder model); this object answers the rest of what the HTTP layer asks of a main model:
its name, tokenizer and context length, readiness (the encoder loop's heartbeat), internal state,
/tokenize and /detokenize, and a clear 400 for every generation route. It holds no request of
its own: `rid_to_state` stays empty, so the shutdown drain waits only on the managers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sluice.checkpoint.encoder_config import EncoderConfig
from sluice.tokenizer.embedding_manager import EncoderManager
from sluice.tokenizer.model_client import OwnsClient
from sluice.tokenizer.normalize import RequestError


class EncoderFrontend(OwnsClient):  # its health: its manager's client's
    can_generate = False
    embedding_manager = None  # the decoder's pooled requests: there is no decoder
    counters = None

    def __init__(self, manager: EncoderManager, cfg: EncoderConfig) -> None:
        self.manager = manager
        self.client = manager.client
        self.model_config = cfg
        self.model_name = manager.model_name
        self.tokenizer = manager.tokenizer
        self.context_len = manager.context_len
        self.max_total_tokens = 0
        self.server_ready = True
        self.shutting_down = False
        self.rid_to_state: dict[str, Any] = {}

    # ---- lifecycle: the manager is one of the launcher's encoder managers, which starts,
    # stops and tells it of a child's death; nothing here to do twice

    async def close(self) -> None:
        pass

    def on_child_death(self, message: str) -> None:
        pass

    def begin_shutdown(self) -> None:
        self.shutting_down = True

    def abort_all_for_shutdown(self) -> int:
        return 0

    # ---- what a generation model would do ------------------------------------------------

    def _cannot_generate(self) -> RequestError:
        kind = "cross-encoder (rerank)" if self.manager.task == "rerank" else "embedding"
        return RequestError(
            f"this server serves no generation model: '{self.model_name}' is an {kind} model; "
            "use /v1/embeddings or /v1/rerank",
            param="model",
        )

    def generate_request(
        self, obj: Any, tick: float | None = None
    ) -> AsyncIterator[dict[str, Any] | None]:
        """Refuses at the call, before any stream exists (the routes answer 400)."""
        raise self._cannot_generate()

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise self._cannot_generate()

    async def open_session(self, *args: Any) -> str:
        raise self._cannot_generate()

    def close_session(self, session_id: str) -> None:
        pass

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> int:
        return 0  # generation rids only; pooled requests end with their HTTP calls

    async def flush_cache(self) -> bool:
        return True  # an encoder caches nothing

    def set_paused(self, paused: bool) -> None:
        self.manager.set_paused(paused)

    # ---- services -------------------------------------------------------------------------

    async def get_internal_state(self) -> dict[str, Any]:
        return await self.manager.get_internal_state()

    def num_req_states(self) -> int:
        return len(self.manager.pending)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise RequestError("the text to tokenize must be a string", param="prompt")
        return await self.manager.in_tokenizer_thread(
            lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        )

    async def detokenize(self, ids: list[int]) -> str:
        size = len(self.tokenizer)
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < size for t in ids):
            raise RequestError(f"tokens must be a list of ids in [0, {size})", param="tokens")
        return await self.manager.in_tokenizer_thread(self.tokenizer.decode, ids)
