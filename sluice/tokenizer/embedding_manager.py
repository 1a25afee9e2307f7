"""EmbeddingManager: the HTTP process's end of an encoder model (embeddings, cross-encoder scores).

Inputs (texts, token ids, or (query, document) pairs for a cross-encoder) are tokenized off the
event loop, validated (empty, out-of-vocabulary and over-long inputs are RequestErrors, 400),
and sent to the model's encoder scheduler as one message; vectors come back as
BatchEmbeddingOutput and resolve one future per input.

Ownership: `pending` holds exactly the rids sent and not yet answered. A call that ends early
(error, cancellation) removes its rids and sends an AbortReq for them. Each extra model of a
server has its own manager, its own scheduler process and its own sockets: the scheduler pushes
straight to this manager's socket (there is no text to detokenize).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from sluice.config import ServerArgs
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenizedEmbeddingReqInput,
    FinishReason,
    GetInternalStateReq,
    InternalStateReply,
    TokenizedEmbeddingReqInput,
)
from sluice.model.encoder_config import default_embedding_model_path, is_encoder_model
from sluice.tokenizer.normalize import RequestError
from sluice.utils import ipc

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 60.0
NONE_VALUES = ("", "none", "None")


@dataclass(frozen=True)
class Encoded:
    """One tokenized input: ids, and token types for a pair."""

    input_ids: list[int]
    token_type_ids: list[int] | None = None


@dataclass(frozen=True)
class EncoderSpec:
    """An extra encoder model of a server: its child name, its args and its sockets."""

    name: str  # "embedding" | "rerank": the child process's name in the launcher
    args: ServerArgs  # the server's args with this model's path
    addrs: ipc.IpcAddrs  # detokenizer_in == tokenizer_in: the scheduler replies straight here


def plan_encoders(args: ServerArgs) -> list[EncoderSpec]:
    """The extra encoder models `args` asks for; ValueError for a path that is not one."""
    paths = {"embedding": _embedding_path(args), "rerank": args.rerank_model_path}
    specs = []
    for name, path in paths.items():
        if path in (None, *NONE_VALUES):
            continue
        if not is_encoder_model(path):
            raise ValueError(
                f"--{name}-model-path {path!r} is not a supported encoder model directory "
                "(a BERT config.json)"
            )
        addrs = ipc.IpcAddrs.create()
        addrs = dataclasses.replace(addrs, detokenizer_in=addrs.tokenizer_in)
        child_args = args.replace(model_path=path, served_model_name=None, context_length=0)
        specs.append(EncoderSpec(name, child_args, addrs))
    return specs


def _embedding_path(args: ServerArgs) -> str | None:
    if args.no_embedding_model:
        return None
    if args.embedding_model_path == "auto":
        return default_embedding_model_path()
    return args.embedding_model_path


def start_manager(spec: EncoderSpec, info: dict[str, Any]) -> EmbeddingManager:
    """The manager of a ready encoder child (blocking: loads the tokenizer)."""
    from sluice.utils.tokenizer import get_tokenizer

    return EmbeddingManager(get_tokenizer(str(info["hf_dir"])), spec.addrs, info)


class EmbeddingManager:
    def __init__(self, tokenizer: Any, addrs: ipc.IpcAddrs, info: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.model_name = str(info["model_name"])
        self.task = str(info["task"])  # "embed" | "rerank"
        self.context_len = int(info["context_len"])
        self.vocab_size = int(info["vocab_size"])
        self.dimensions = int(info["dimensions"])
        self.is_healthy = True
        self.pending: dict[str, asyncio.Future[tuple[bytes, int, FinishReason]]] = {}
        self._reply_to = addrs.tokenizer_in
        self._ctx = zmq.asyncio.Context()
        self._to_scheduler = ipc.push_socket(zmq.Context.shadow(self._ctx), addrs.scheduler_in)
        self._recv_sock = ipc.pull_socket(self._ctx, addrs.tokenizer_in)
        self._state_waiters: deque[asyncio.Future[InternalStateReply]] = deque()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed-tokenize")
        self._loop_task: asyncio.Task[None] | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for sock in (self._to_scheduler, self._recv_sock):
            sock.close(linger=0)
        self._ctx.term()
        self._executor.shutdown(wait=False)

    def on_child_death(self, message: str) -> None:
        self.is_healthy = False
        for fut in [*self.pending.values(), *self._state_waiters]:
            if not fut.done():
                fut.set_exception(_unavailable(message))
        self.pending.clear()
        self._state_waiters.clear()

    # ---- requests -------------------------------------------------------------------------

    async def embed(
        self, inputs: list[str] | list[list[int]], truncate: int | None = None
    ) -> tuple[list[np.ndarray], int]:
        """One float32 vector per input, in order, and the number of prompt tokens."""
        if not inputs:
            raise RequestError("input must not be empty", param="input")
        encoded = await self._run(self._encode_inputs, inputs, truncate)
        return await self.run(encoded)

    async def score_pairs(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        """A cross-encoder's score of (query, document) for each document; documents that do
        not fit the context with the query are truncated."""
        encoded = await self._run(self._encode_pairs, query, documents)
        vectors, num_tokens = await self.run(encoded)
        return [float(v[0] if len(v) == 1 else v[-1]) for v in vectors], num_tokens

    async def run(self, encoded: list[Encoded]) -> tuple[list[np.ndarray], int]:
        self._check_healthy()
        for e in encoded:
            self._validate(e.input_ids)
        base = uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(len(encoded))]
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in rids]
        self.pending.update(zip(rids, futures, strict=True))
        reqs = [
            TokenizedEmbeddingReqInput(rid, e.input_ids, e.token_type_ids, self._reply_to)
            for rid, e in zip(rids, encoded, strict=True)
        ]
        try:
            ipc.send(
                self._to_scheduler,
                reqs[0] if len(reqs) == 1 else BatchTokenizedEmbeddingReqInput(reqs),
            )
            results = await asyncio.gather(*futures)
        finally:
            self._release(rids)
        return [self._vector(data, reason) for data, _, reason in results], sum(
            n for _, n, _ in results
        )

    def _vector(self, data: bytes, reason: FinishReason) -> np.ndarray:
        if reason.type == "abort":
            raise RequestError(
                reason.message or "the request was aborted",
                status_code=reason.status_code or 500, code=reason.code,
            )  # fmt: skip
        return np.frombuffer(data, dtype="<f4")

    def _release(self, rids: list[str]) -> None:
        unanswered = [rid for rid in rids if self.pending.pop(rid, None) is not None]
        if unanswered and self.is_healthy:
            for rid in unanswered:
                ipc.send(self._to_scheduler, AbortReq(rid=rid))

    # ---- tokenization (in the executor thread) ----------------------------------------------

    def _encode_inputs(
        self, inputs: list[str] | list[list[int]], truncate: int | None
    ) -> list[Encoded]:
        out = []
        texts = [(i, t) for i, t in enumerate(inputs) if isinstance(t, str)]
        for _, text in texts:
            if not text.strip():
                raise RequestError("input strings must not be empty", param="input")
        limit = None if truncate is None else min(truncate, self.context_len)
        encoded = {}
        if texts:
            kwargs = {"truncation": True, "max_length": limit} if limit else {}
            ids = self.tokenizer([t for _, t in texts], **kwargs)["input_ids"]
            encoded = {i: list(x) for (i, _), x in zip(texts, ids, strict=True)}
        for i, item in enumerate(inputs):
            seq = encoded[i] if i in encoded else list(item)
            out.append(Encoded(seq[:limit] if limit else seq))
        return out

    def _encode_pairs(self, query: str, documents: list[str]) -> list[Encoded]:
        try:
            enc = self.tokenizer(
                [query] * len(documents), documents, truncation="only_second",
                max_length=self.context_len,
            )  # fmt: skip
        except Exception as e:  # the query alone does not fit
            raise RequestError(f"the query is too long for this model: {e}", param="query") from e
        types = enc.get("token_type_ids") or [None] * len(documents)
        return [
            Encoded(list(i), list(t) if t else None)
            for i, t in zip(enc["input_ids"], types, strict=True)
        ]

    def _validate(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("input must not be empty", param="input")
        bad = next((t for t in ids if not (type(t) is int and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise RequestError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="input"
            )
        if len(ids) > self.context_len:
            raise RequestError(
                f"This model's maximum context length is {self.context_len} tokens. However, "
                f"an input has {len(ids)} tokens. Shorten it, or set truncate_prompt_tokens.",
                code="context_length_exceeded", param="input",
            )  # fmt: skip

    # ---- receiving ------------------------------------------------------------------------

    async def _handle_loop(self) -> None:
        while True:
            frames = await self._recv_sock.recv_multipart()
            try:
                self._dispatch(ipc.decode(frames))
            except Exception:  # this loop must outlive any one bad message
                logger.exception("failed to handle a message from the encoder")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchEmbeddingOutput):
            self.on_output(msg)
        elif isinstance(msg, InternalStateReply):
            if self._state_waiters:
                fut = self._state_waiters.popleft()
                if not fut.done():
                    fut.set_result(msg)
        else:
            logger.debug("ignored a %s", type(msg).__name__)

    def on_output(self, out: BatchEmbeddingOutput) -> None:
        for rid, data, num, reason in zip(
            out.rids, out.embeddings, out.prompt_tokens, out.finished_reasons, strict=True
        ):
            fut = self.pending.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result((data, num, reason))

    async def get_internal_state(self) -> dict[str, Any]:
        self._check_healthy()
        fut = asyncio.get_running_loop().create_future()
        self._state_waiters.append(fut)
        ipc.send(self._to_scheduler, GetInternalStateReq())
        reply = await asyncio.wait_for(fut, CONTROL_TIMEOUT_S)
        return {**msgspec.structs.asdict(reply.state), "num_req_states": len(self.pending)}

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _check_healthy(self) -> None:
        if not self.is_healthy:
            raise _unavailable("the server is shutting down after a process failure")


def _unavailable(message: str) -> RequestError:
    return RequestError(message, status_code=503, code="service_unavailable")
