"""The HTTP process's end of pooled requests: embeddings and scores, by an encoder or the decoder.

`EmbeddingManager` is the request logic. Inputs (texts, token ids, or (query, document) pairs
for a cross-encoder) are tokenized off the event loop, validated (empty, out-of-vocabulary and
over-long inputs are RequestErrors, 400), and sent to the model's scheduler as one message;
vectors come back as BatchEmbeddingOutput (`on_output`) and resolve one future per input. With
`label_token_ids` (a decoder only) each vector is the next-token log-probabilities of those ids.

Ownership: `pending` holds exactly the rids sent and not yet answered. A call that ends early
(error, cancellation) removes its rids and sends an AbortReq for them. How messages travel is
not this class's business: it is given a `send` callable and is handed the outputs.
- An extra encoder model of a server is an `EncoderManager`: its own scheduler process, and its
  own ModelClient (sockets, receive loop, control calls); the scheduler pushes straight to it.
- The decoder's manager (`decoder_info`) is owned by the TokenizerManager: it sends on the
  TokenizerManager's scheduler socket, shares its tokenizer thread, and gets its outputs from
  the TokenizerManager's receive loop (the detokenizer passes them through unchanged).

Counting (`counters`, exported by /metrics summed with the generation requests'): each pooled
rid that ends early is counted once, by whoever takes it out of `pending` first: `abort_all`
("abort_request" or "shutdown"), the end of a call with rids unanswered (its caller is gone:
"client_disconnect"), or `on_output` (an abort finish of the scheduler: timeout, invalid,
internal error; or an answer that arrived after its caller was cancelled). A call ended while
being tokenized has no rids yet and counts once, as in abort_all's return value. Rids ended by
a child's death are not counted, as for generation. Refusals (429, 503 "shutting_down") are
counted where they are raised here; the decoder's are counted by its owner's `admit`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from sluice.checkpoint.encoder_config import default_embedding_model_path, is_encoder_model
from sluice.config import ServerArgs
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenizedEmbeddingReqInput,
    FinishReason,
    GetInternalStateReq,
    InternalStateReply,
    ModelInfo,
    SetPausedReq,
    TokenizedEmbeddingReqInput,
)
from sluice.tokenizer.counters import RequestCounters
from sluice.tokenizer.model_client import (
    PROCESS_FAILURE,
    ModelClient,
    OwnsClient,
    shutting_down_error,
    unavailable_error,
)
from sluice.tokenizer.normalize import RequestError, queue_full_error
from sluice.utils import ipc

NONE_VALUES = ("", "none", "None")
# a model's `task` (its card's) → the routes it serves
TASKS = {
    "embed": ("embed", "rerank"),  # rerank by cosine similarity
    "rerank": ("rerank",),  # a cross-encoder
    "generate": ("generate", "embed", "score", "rerank"),  # the decoder
}


@dataclass(frozen=True)
class Encoded:
    """One tokenized input: ids, and token types for a pair."""

    input_ids: list[int]
    token_type_ids: list[int] | None = None


@dataclass(frozen=True)
class EncoderSpec:
    """An encoder model of a server: its child name, its args and its sockets."""

    name: str  # "encoder" (the main model) | "embedding" | "rerank": the child's name
    args: ServerArgs  # the server's args (with this model's path, for an extra model)
    addrs: ipc.IpcAddrs  # detokenizer_in == tokenizer_in: the scheduler replies straight here


def plan_encoders(args: ServerArgs) -> list[EncoderSpec]:
    """The encoder models `args` asks for, each in its own process: the main model first when
    `--model-path` is an encoder (then no default embedding model is added), then the extra
    ones. ValueError for an extra path that is not an encoder, and for a --quantization other
    than auto/none on an encoder main model (extra encoders always run in --dtype)."""
    main_is_encoder = is_encoder_model(args.model_path)
    if main_is_encoder and args.quantization not in ("auto", "none"):
        raise ValueError(
            f"--quantization {args.quantization} applies to generative models; "
            f"{args.model_path} is an encoder (embedding or rerank) model, served in --dtype"
        )
    specs = [_spec("encoder", args)] if main_is_encoder else []
    embedding = (
        None if main_is_encoder and args.embedding_model_path == "auto" else _embedding_path(args)
    )
    paths = {"embedding": embedding, "rerank": args.rerank_model_path}
    for name, path in paths.items():
        if path in (None, *NONE_VALUES):
            continue
        if not is_encoder_model(path):
            raise ValueError(
                f"--{name}-model-path {path!r} is not a supported encoder model directory "
                "(a BERT config.json)"
            )
        specs.append(
            _spec(name, args.replace(model_path=path, served_model_name=None, context_length=0))
        )
    return specs


def _spec(name: str, args: ServerArgs) -> EncoderSpec:
    addrs = ipc.IpcAddrs.create(args.tokenizer_worker_num)  # one reply address per HTTP worker
    return EncoderSpec(name, args, dataclasses.replace(addrs, detokenizer_in=addrs.tokenizer_in))


def _embedding_path(args: ServerArgs) -> str | None:
    if args.no_embedding_model:
        return None
    if args.embedding_model_path == "auto":
        return default_embedding_model_path()
    return args.embedding_model_path


def start_manager(spec: EncoderSpec, info: ModelInfo) -> EncoderManager:
    """The manager of a ready encoder child (blocking: loads the tokenizer). The main model
    answers to --served-model-name."""
    from sluice.utils.tokenizer import get_tokenizer

    if spec.args.served_model_name:
        info = msgspec.structs.replace(info, model_name=spec.args.served_model_name)
    tokenizer = get_tokenizer(info.hf_dir)
    return EncoderManager(tokenizer, spec.addrs, info, spec.args.max_queued_requests)


def decoder_info(info: ModelInfo, model_name: str) -> ModelInfo:
    """The `info` of the decoder's pooled requests: vectors are last-token hidden states; a
    prompt fits the context and the KV pool."""
    context_len = min(info.context_len, info.max_total_tokens)
    return msgspec.structs.replace(info, model_name=model_name, context_len=context_len)


class EmbeddingManager:
    """`send(msg)` puts a message on the way to the model's scheduler; `admit(n)` (optional)
    raises a RequestError (429, 503) when `n` more requests may not go in now. `executor`: the
    one thread that may call `tokenizer` (this manager makes and owns one when None)."""

    def __init__(
        self,
        tokenizer: Any,
        info: ModelInfo,
        send: Callable[[Any], None],
        reply_to: str,
        executor: ThreadPoolExecutor | None = None,
        admit: Callable[[int], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = info.model_name
        self.task = info.task  # "embed" | "rerank" | "generate"
        self.tasks = TASKS[self.task]
        self.context_len = info.context_len
        self.vocab_size = info.vocab_size
        self.dimensions = info.dimensions
        self.is_healthy = True
        self.shutting_down = False  # set by begin_shutdown: new calls get 503
        self.pending: dict[str, asyncio.Future[tuple[bytes, int, FinishReason]]] = {}
        self.counters = RequestCounters()  # early ends of this manager's rids (module docstring)
        # abort_all() ends calls still in the tokenizer thread too (tokenize_for_call)
        # calls in the tokenizer thread, by the abort generation they started in: abort_all
        # ends (and counts) those of the current generation only, each once
        self._tokenizing: dict[int, int] = {}
        self._abort_generation = 0
        # the error of the abort_all that ended a generation's tokenizing calls, while any is left
        self._ended_by: dict[int, RequestError] = {}
        self._send = send
        self._reply_to = reply_to
        self._admit = admit
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="embed-tokenize"
        )

    @property
    def is_decoder(self) -> bool:
        return self.task == "generate"

    def on_child_death(self, message: str) -> None:
        self.is_healthy = False
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(unavailable_error(message))
        self.pending.clear()

    def begin_shutdown(self) -> None:
        """Refuse new calls (503 "shutting_down"); those pending go on. The decoder's manager
        is gated by its owner's `admit` instead, which counts the refusal."""
        self.shutting_down = True

    def abort_all(self, status: int, code: str, message: str, reason: str = "client") -> int:
        """End every pending call now: its futures raise RequestError(message, status, code),
        and the scheduler gets AbortReqs (`reason`: "client" | "shutdown") for their rids. Calls
        still being tokenized end with the same error once that is done, sending nothing.
        Returns the number ended: pending rids (one per input) plus calls being tokenized (one
        each: their inputs are not counted yet)."""
        tokenizing = self._tokenizing.get(self._abort_generation, 0)
        if tokenizing:
            error = RequestError(message, status_code=status, code=code)
            self._ended_by[self._abort_generation] = error
        self._abort_generation += 1
        rids = list(self.pending)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(RequestError(message, status_code=status, code=code))
        self.pending.clear()
        if rids and self.is_healthy:
            self._send_aborts(rids, reason)
        cause = "shutdown" if reason == "shutdown" else "abort_request"
        self.counters.count_abort(cause, len(rids) + tokenizing)
        return len(rids) + tokenizing

    def set_paused(self, paused: bool) -> None:
        """Pause or continue the model's scheduler (fire and forget, ordered with requests)."""
        if self.is_healthy:
            self._send(SetPausedReq(paused))

    def _send_aborts(self, rids: list[str], reason: str) -> None:
        if self.is_decoder:  # its scheduler's abort_all would end generation requests too
            for rid in rids:
                self._send(AbortReq(rid=rid, reason=reason))
        else:  # an encoder's scheduler holds this manager's requests only
            self._send(AbortReq(abort_all=True, reason=reason))

    # ---- requests -------------------------------------------------------------------------

    async def embed(
        self, inputs: list[str] | list[list[int]], truncate: int | None = None
    ) -> tuple[list[np.ndarray], int]:
        """One float32 vector per input, in order, and the number of prompt tokens."""
        if not inputs:
            raise RequestError("input must not be empty", param="input")
        encoded = await self.tokenize_for_call(self._encode_inputs, inputs, truncate, "input")
        return await self.run(encoded)

    async def score_labels(
        self, prompts: list[str] | list[list[int]], label_token_ids: list[int], param: str
    ) -> tuple[list[np.ndarray], int]:
        """A decoder's next-token log-probabilities of `label_token_ids` (in their order) after
        each prompt, and the number of prompt tokens. Over-long prompts are a 400 (`param`)."""
        if not self.is_decoder:
            raise RequestError(
                f"the model '{self.model_name}' is an encoder: scoring needs a decoder",
                param="model",
            )
        self._validate_labels(label_token_ids)
        encoded = await self.tokenize_for_call(self._encode_inputs, prompts, None, param)
        return await self.run(encoded, list(label_token_ids), param)

    async def score_pairs(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        """A cross-encoder's score of (query, document) for each document; documents that do
        not fit the context with the query are truncated."""
        encoded = await self.tokenize_for_call(self._encode_pairs, query, documents)
        vectors, num_tokens = await self.run(encoded)
        return [float(v[0] if len(v) == 1 else v[-1]) for v in vectors], num_tokens

    async def run(
        self,
        encoded: list[Encoded],
        label_token_ids: list[int] | None = None,
        param: str = "input",
    ) -> tuple[list[np.ndarray], int]:
        self._check_healthy()
        self._check_accepting()
        for e in encoded:
            self._validate(e.input_ids, param)
        if self._admit is not None:
            self._admit(len(encoded))
        base = uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(len(encoded))]
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in rids]
        self.pending.update(zip(rids, futures, strict=True))
        reqs = [
            TokenizedEmbeddingReqInput(
                rid=rid,
                input_ids=e.input_ids,
                token_type_ids=e.token_type_ids,
                label_token_ids=label_token_ids,
                reply_to=self._reply_to,
            )  # fmt: skip
            for rid, e in zip(rids, encoded, strict=True)
        ]
        try:
            self._send(reqs[0] if len(reqs) == 1 else BatchTokenizedEmbeddingReqInput(reqs))
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
        """The end of a call: its rids still pending were disconnected (the others were
        answered, or ended already by abort_all or a child's death)."""
        unanswered = [rid for rid in rids if self.pending.pop(rid, None) is not None]
        self.counters.count_abort("client_disconnect", len(unanswered))
        if unanswered and self.is_healthy:
            for rid in unanswered:
                self._send(AbortReq(rid=rid))

    # ---- tokenization (in the executor thread) ----------------------------------------------

    def _encode_inputs(
        self, inputs: list[str] | list[list[int]], truncate: int | None, param: str
    ) -> list[Encoded]:
        texts = [(i, t) for i, t in enumerate(inputs) if isinstance(t, str)]
        for _, text in texts:
            if not text.strip():
                raise RequestError(f"{param} strings must not be empty", param=param)
        limit = None if truncate is None else min(truncate, self.context_len)
        encoded = {}
        if texts:
            kwargs = {"truncation": True, "max_length": limit} if limit else {}
            ids = self.tokenizer([t for _, t in texts], **kwargs)["input_ids"]
            encoded = {i: list(x) for (i, _), x in zip(texts, ids, strict=True)}
        out = []
        for i, item in enumerate(inputs):
            seq = encoded[i] if i in encoded else list(item)
            if i not in encoded:  # every id the client sent is checked, the truncated ones too
                self._check_vocab(seq, param)
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

    def _validate(self, ids: list[int], param: str) -> None:
        if not ids:
            raise RequestError(f"{param} must not be empty", param=param)
        self._check_vocab(ids, param)
        if len(ids) > self.context_len:
            raise RequestError(
                f"This model's maximum context length is {self.context_len} tokens. However, "
                f"an input has {len(ids)} tokens. Shorten it"
                + (", or set truncate_prompt_tokens." if param == "input" else "."),
                code="context_length_exceeded", param=param,
            )  # fmt: skip

    def _check_vocab(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not (type(t) is int and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise RequestError(
                f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})", param=param
            )

    def _validate_labels(self, label_token_ids: list[int]) -> None:
        if not label_token_ids:
            raise RequestError("label_token_ids must not be empty", param="label_token_ids")
        bad = next(
            (t for t in label_token_ids if not (type(t) is int and 0 <= t < self.vocab_size)), None
        )
        if bad is not None:
            raise RequestError(
                f"label token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                param="label_token_ids",
            )

    # ---- receiving ------------------------------------------------------------------------

    def on_output(self, out: BatchEmbeddingOutput) -> None:
        """Resolve the futures of the rids of `out`; a rid no longer pending (aborted, or its
        caller gone) is dropped."""
        for rid, data, num, reason in zip(
            out.rids, out.embeddings, out.prompt_tokens, out.finished_reasons, strict=True
        ):
            fut = self.pending.pop(rid, None)
            if fut is None:
                continue
            if fut.done():
                # cancelled with its call (nothing else leaves a pending future done): the
                # call's _release no longer finds this rid, so its early end is counted here
                self.counters.count_abort("client_disconnect")
            else:
                if reason.type == "abort":
                    self.counters.count_finish(msgspec.structs.asdict(reason))
                fut.set_result((data, num, reason))

    async def in_tokenizer_thread(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the one thread that may use this manager's tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def tokenize_for_call(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in the tokenizer thread for a call that then runs: if abort_all() ends
        the pending calls meanwhile, this one ends with them (RequestError) instead of starting."""
        generation = self._abort_generation
        self._tokenizing[generation] = self._tokenizing.get(generation, 0) + 1
        ended: RequestError | None = None
        try:
            result = await self.in_tokenizer_thread(fn, *args)
        except RequestError:
            if generation == self._abort_generation:
                raise
            result = None  # counted as aborted: it ends as such, not with its own 400
        except asyncio.CancelledError:
            if generation == self._abort_generation:  # else abort_all counted it
                self.counters.count_abort("client_disconnect")
            raise
        finally:
            ended = self._end_tokenizing(generation)
        if ended is not None:
            raise RequestError(ended.message, status_code=ended.status_code, code=ended.code)
        return result

    def _end_tokenizing(self, generation: int) -> RequestError | None:
        """One call of `generation` left the tokenizer thread: the error of the abort_all that
        ended it, if one did."""
        ended = self._ended_by.get(generation)
        self._tokenizing[generation] -= 1
        if not self._tokenizing[generation]:
            del self._tokenizing[generation]
            self._ended_by.pop(generation, None)
        return ended

    def _check_healthy(self) -> None:
        if not self.is_healthy:
            raise unavailable_error(PROCESS_FAILURE)

    def _check_accepting(self) -> None:
        if self.shutting_down:
            raise shutting_down_error(self.counters)

    def shutdown_executor(self) -> None:
        if self._owns_executor:
            self._executor.shutdown(wait=False)


class EncoderManager(OwnsClient, EmbeddingManager):
    """An extra encoder model's manager: its ModelClient holds the sockets to its scheduler
    process and the loop that receives from it. Its health is the client's (OwnsClient)."""

    def __init__(
        self, tokenizer: Any, addrs: ipc.IpcAddrs, info: ModelInfo, max_queued: int = 0
    ) -> None:
        # internal state is the only control call an encoder's manager makes
        self.client = ModelClient(addrs, (InternalStateReply,), peer="encoder")
        # --max-queued-requests: beyond the batch the encoder runs at once plus this, a 429
        self._max_running, self._max_queued = info.max_running_requests, max_queued
        super().__init__(
            tokenizer, info, self.client.send, self.client.reply_to, admit=self._admit_queued
        )
        self.client.on(BatchEmbeddingOutput, self.on_output)

    def _admit_queued(self, num_reqs: int) -> None:
        err = queue_full_error(len(self.pending), num_reqs, self._max_running, self._max_queued)
        if err is not None:
            self.counters.rejected["queue_full"] += 1
            raise err

    def start(self) -> None:
        self.client.start()

    async def close(self) -> None:
        await self.client.close()
        self.shutdown_executor()

    def on_child_death(self, message: str) -> None:
        super().on_child_death(message)
        self.client.on_child_death(message)

    async def get_internal_state(self) -> dict[str, Any]:
        reply = await self.client.control(GetInternalStateReq(), InternalStateReply)
        return {**msgspec.structs.asdict(reply.state), "num_req_states": len(self.pending)}
