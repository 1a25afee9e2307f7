"""A fake TokenizerManager for unit tests of the HTTP layer, and an app client around it; and
`default_chat`, one real default chat server shared by the end-to-end files that only read.

The fake "generates" a fixed script of tokens per (prompt, sample) index, interleaving indexes
when streaming, and records every request it got and every generator it had closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sluice.config import ServerArgs
from sluice.server.app import create_app
from sluice.tokenizer.generate_input import GenerateReqInput
from tests.server.live_server import LiveServer, default_chat_server

# token id -> text; ids 0..3 are special
VOCAB = [
    "<s>",
    "</s>",
    "<pad>",
    "<unk>",
    "Hel",
    "lo",
    " w",
    "ö",
    "rld",
    "!",
    "a",
    "b",
    " ",
    "你",
    "好",
]
SCRIPT = [4, 5, 6, 7, 8, 9]  # "Hello wörld!"
EOS = 1


class FakeRequestError(Exception):
    def __init__(self, message: str, status_code: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.code, self.param = message, status_code, code, None


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i < 4))

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return VOCAB[token_id]

    def encode(self, text: str) -> list[int]:
        return [VOCAB.index(c) if c in VOCAB else 3 for c in text]


@dataclass
class FakeTokenizerManager:
    model_name: str = "fake-model"
    context_len: int = 64
    is_healthy: bool = True
    server_ready: bool = True
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    model_config: Any = None
    # the rest of MainModel's attributes, as for a decoder that never sent a heartbeat
    can_generate: bool = True
    embedding_manager: Any = None
    manager: Any = None
    counters: Any = None
    shutting_down: bool = False
    last_scheduler_contact: float = 0.0
    heartbeat_seen: bool = False
    requests: list[GenerateReqInput] = field(default_factory=list)
    num_closed: int = 0
    fail_with: Exception | None = None  # raised before anything is yielded
    abort_at: int | None = None  # finish with an abort after this many tokens
    first_delay: float = 0.0  # seconds before the first token
    hang: bool = False  # never yield
    state: dict[str, Any] = field(
        default_factory=lambda: {
            "num_running_reqs": 0, "num_waiting_reqs": 0, "kv_total": 100, "kv_free": 90,
            "kv_cached": 10, "kv_in_use": 0, "last_heartbeat": 0.0, "num_req_states": 0,
            "num_detokenizer_states": 0,
        }
    )  # fmt: skip
    templates: list[list[dict[str, Any]]] = field(default_factory=list)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        self.templates.append(messages)
        return "".join(m["content"] for m in messages)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([0] if add_special_tokens else []) + self.tokenizer.encode(text)

    async def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    async def get_internal_state(self) -> dict[str, Any]:
        return dict(self.state)

    async def flush_cache(self) -> bool:
        return True

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        return None

    async def generate_request(
        self, obj: GenerateReqInput, tick: float | None = None
    ) -> AsyncIterator[dict[str, Any] | None]:
        self.requests.append(obj)
        if self.fail_with is not None:
            raise self.fail_with
        try:
            await asyncio.sleep(self.first_delay)
            while self.hang:
                await asyncio.sleep(3600 if tick is None else tick)
                if tick is not None:
                    yield None  # the keep-alive tick of a stream
            for out in self._run(obj):
                if obj.stream or out["meta_info"]["finish_reason"] is not None:
                    yield out
        finally:
            self.num_closed += 1

    def _prompts(self, obj: GenerateReqInput) -> list[list[int]]:
        if obj.text is not None:
            texts = [obj.text] if isinstance(obj.text, str) else obj.text
            return [self.tokenizer.encode(t) for t in texts]
        ids = obj.input_ids
        return [ids] if obj.is_single else ids  # type: ignore[list-item,return-value]

    def _run(self, obj: GenerateReqInput) -> list[dict[str, Any]]:
        """All updates, round-robin over indexes (index = prompt * n + sample)."""
        params = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
        n, limit = int(params.get("n", 1)), params.get("max_new_tokens")
        if limit is not None and limit < 0:
            raise FakeRequestError("max_new_tokens must be at least 0")
        num = len(SCRIPT) if limit is None else min(limit, len(SCRIPT))
        prompts = self._prompts(obj)
        items = [(p, i * n + s) for i, p in enumerate(prompts) for s in range(n)]
        updates = []
        for step in range(1, num + 1):
            for prompt, index in items:
                updates.append(self._update(obj, prompt, index, step, num, limit))
        return updates

    def _update(
        self, obj: GenerateReqInput, prompt: list[int], index: int, step: int, num: int, limit: Any
    ) -> dict[str, Any]:
        ids = SCRIPT[:step]
        finish = None
        if self.abort_at is not None and step >= self.abort_at:
            finish = {
                "type": "abort",
                "message": "out of memory",
                "status_code": 503,
                "code": "oom",
            }
        elif step == num:
            finish = (
                {"type": "length"}
                if limit is not None and limit < len(SCRIPT)
                else {"type": "stop", "matched": EOS}
            )
        meta: dict[str, Any] = {
            "id": f"rid-{index}", "finish_reason": finish, "prompt_tokens": len(prompt),
            "completion_tokens": step, "cached_tokens": 2, "e2e_latency": 0.01,
        }  # fmt: skip
        if obj.return_logprob:
            top = obj.top_logprobs_num
            meta["output_token_logprobs"] = [(-0.5 * k, t) for k, t in enumerate(ids)]
            meta["output_top_logprobs"] = [
                [(-0.5 * k, t), (-3.0, 10)][:top] for k, t in enumerate(ids)
            ]
            if obj.logprob_start_len == 0:
                meta["input_token_logprobs"] = [
                    (None if k == 0 else -1.0, t) for k, t in enumerate(prompt)
                ]
                meta["input_top_logprobs"] = [
                    None if k == 0 else [(-1.0, t)][:top] for k, t in enumerate(prompt)
                ]
        text = "".join(VOCAB[t] for t in ids)
        return {
            "index": index, "text": text, "delta": VOCAB[ids[-1]], "output_ids": list(ids),
            "meta_info": meta, "new_logprob_count": 1 if obj.return_logprob else 0,
        }  # fmt: skip


@pytest.fixture
def fake_tm() -> FakeTokenizerManager:
    return FakeTokenizerManager()


@pytest.fixture
def make_client(fake_tm: FakeTokenizerManager) -> Callable[..., TestClient]:
    def make(**args: Any) -> TestClient:
        app = create_app(fake_tm, ServerArgs(**args), keepalive_interval=0.05)
        return TestClient(app, raise_server_exceptions=False)

    return make


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


@pytest.fixture(scope="session")
def default_chat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`default_chat_server`, started once for the session. Its users only send requests: none
    pauses, flushes, stops it or counts metrics, and each file's last test asserts the server
    idle with nothing left behind (so the next file finds it as a fresh one, its prefix cache
    aside)."""
    with default_chat_server(tmp_path_factory, "default_chat") as srv:
        yield srv
