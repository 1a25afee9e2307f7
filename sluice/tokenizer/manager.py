"""TokenizerManager: the HTTP process's end of the request path (asyncio, one event loop).

A GenerateReqInput is normalized into (prompt, sample) items, tokenized off the event loop,
validated, and sent to the scheduler as one message (a BatchTokenizedGenerateReqInput when it
holds several items). Text comes back from the detokenizer as BatchStrOutput and is merged into
one ReqState per rid; `generate_request` yields one dict per update of an item (and, for a
stream, None at each keep-alive tick: `Updates` in req_state.py, one timer per call rather than
a wait_for per token).

Ownership: `rid_to_state` holds exactly the rids of live `generate_request` calls. A state is
removed when its finish arrives, when it is aborted here (/abort_request, shutdown), and again
(if still there) in the call's `finally`, which covers errors, client disconnects and
cancellation. A rid ended here after it was sent to the scheduler gets an AbortReq and waits in
`awaiting_echo` for the one finish the scheduler sends for every rid it took in; a rid ended
before it was sent (still tokenizing, or its images still fetched or processed) never reaches
the scheduler, and once no item of its call is left, that call's preparation is cancelled. An
output for a rid in neither place is a zombie (`counters.unknown_rid_outputs`).

Admission: with --max-queued-requests Q, a request is refused with 429 when the rids in flight
(in `rid_to_state`, awaiting an echo, or pooled requests pending in `embedding_manager`) plus
its own would exceed max_running_requests + Q: counted here, exactly and at once, rather than
from a scheduler report that lags by a step.

Pooled requests of the decoder (embeddings, next-token label scores) belong to
`embedding_manager`, which this manager owns: it sends on this manager's scheduler socket, uses
its tokenizer thread, and gets the BatchEmbeddingOutput that arrive here.

The sockets, the receive loop, control calls and health are `client`'s (a ModelClient, as an
encoder model's manager has); this class registers its handlers of the outputs.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from sluice.aborts import SHUTDOWN_MESSAGE, aborted, shutdown, unavailable
from sluice.checkpoint.model_config import ModelConfig
from sluice.checkpoint.vision import ImageSlots
from sluice.config import ServerArgs
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenizedGenerateReqInput,
    CloseSessionReq,
    FinishReason,
    FlushCacheReply,
    FlushCacheReq,
    GetInternalStateReq,
    InternalStateReply,
    ModelInfo,
    OpenSessionReply,
    OpenSessionReq,
    SamplingParams,
    SessionParams,
    SetPausedReq,
    TokenizedGenerateReqInput,
)
from sluice.tokenizer import chat
from sluice.tokenizer.counters import RequestCounters
from sluice.tokenizer.embedding_manager import EmbeddingManager, decoder_info
from sluice.tokenizer.generate_input import GenerateReqInput
from sluice.tokenizer.images import ExpandedPrompt, PromptImages, image_data_per_prompt
from sluice.tokenizer.model_client import ModelClient, OwnsClient, shutting_down_error
from sluice.tokenizer.normalize import (
    Item,
    RequestError,
    check_int,
    normalize,
    queue_full_error,
)
from sluice.tokenizer.req_state import ReqState, Updates, merge_update, output_dict
from sluice.tokenizer.tokenizer_thread import INLINE_MAX_CHARS, TokenizerThread
from sluice.utils import ipc

__all__ = ["ReqState", "RequestError", "TokenizerManager"]

# the control replies of a decoder's scheduler this manager asks for
CONTROL_REPLIES = (InternalStateReply, FlushCacheReply, OpenSessionReply)


class TokenizerManager(OwnsClient):
    can_generate = True
    manager = None  # MainModel's encoder manager: a decoder has none

    def __init__(
        self,
        args: ServerArgs,
        model_config: ModelConfig,
        tokenizer: Any,
        addrs: ipc.IpcAddrs,
        scheduler_info: ModelInfo,
    ) -> None:
        self.args = args
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.context_len = scheduler_info.context_len
        self.max_total_tokens = scheduler_info.max_total_tokens
        self.max_running_requests = scheduler_info.max_running_requests
        self.model_name: str = args.served_model_name or model_config.model_name
        self.rid_to_state: dict[str, ReqState] = {}
        self.awaiting_echo: set[str] = set()  # rids ended here, their scheduler finish to come
        self.counters = RequestCounters()
        self.server_ready = False
        self.shutting_down = False  # set by begin_shutdown: no new requests
        # the scheduler and the detokenizer; outputs come back from the detokenizer
        self.client = ModelClient(addrs, CONTROL_REPLIES, peer="detokenizer")
        # one thread: HF tokenizers are not safe to call concurrently (short texts: on the loop)
        self._executor = TokenizerThread(thread_name_prefix="tokenize")
        self.embedding_manager = EmbeddingManager(
            tokenizer,
            decoder_info(scheduler_info, self.model_name),
            send=self.client.send, reply_to=self.client.reply_to,
            executor=self._executor, admit=self._admit_pooled,
        )  # fmt: skip
        self.client.on(BatchStrOutput, self._handle_batch_output)
        # a vision-language model's images; None: text only (no media pool is ever started)
        slots = ImageSlots.of(model_config)
        self.images = None if slots is None else PromptImages(args, model_config, slots, tokenizer)
        # the detokenizer passes them through unchanged
        self.client.on(BatchEmbeddingOutput, self.embedding_manager.on_output)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self.client.start()
        self.server_ready = True

    async def close(self) -> None:
        self.server_ready = False
        await self.client.close()
        self._executor.shutdown(wait=False)
        if self.images is not None:
            await self.images.close()

    def on_child_death(self, message: str) -> None:
        """A child process is gone: fail every live request and control call with 503."""
        self.client.on_child_death(message)
        reason = unavailable(message)
        for state in self.rid_to_state.values():
            state.finish(reason)
            state.notify()
        self.rid_to_state.clear()
        self.awaiting_echo.clear()
        self.embedding_manager.on_child_death(message)

    # ---- generation -----------------------------------------------------------------------

    async def generate_request(
        self, obj: GenerateReqInput, tick: float | None = None
    ) -> AsyncIterator[dict[str, Any] | None]:
        """Yields one dict per update of one item (see module docstring); with stream=False
        only each item's final dict; with `tick`, also None whenever `tick` seconds pass
        without one (a stream's keep-alive), from the start on. Raises RequestError before
        anything is sent."""
        self.client.check_healthy()
        self._check_accepting()
        items = normalize(obj)
        self._check_admission(len(items))
        states = self._register(items, obj, tick)
        updates = states[0].updates
        # ending every item here cancels it (`_finish_here`: an abort while the images are
        # fetched or processed ends at once)
        task = asyncio.ensure_future(self._build_reqs(items, obj, states))
        for state in states:
            state.preparing = task
        try:
            while not await updates.wait_done(task):
                yield None
            reqs = _prepared(task, states)
            self.client.check_healthy()
            self._send_unfinished(reqs, states)  # an item aborted while tokenizing stays here
            async for out in self._wait(states, obj.stream):
                yield out
        finally:
            if not task.done():
                task.cancel()  # this call ended while its prompts were prepared
            elif not task.cancelled():
                task.exception()  # retrieved, however the call ended
            self._release(states)
            updates.close()

    def _send_unfinished(
        self, reqs: list[TokenizedGenerateReqInput] | None, states: list[ReqState]
    ) -> None:
        if reqs is None:
            return
        live = [(r, s) for r, s in zip(reqs, states, strict=True) if not s.finished]
        if not live:
            return
        msg = live[0][0] if len(live) == 1 else BatchTokenizedGenerateReqInput([r for r, _ in live])
        self.client.send(msg)
        for _, state in live:
            state.is_sent = True

    def _check_accepting(self) -> None:
        if self.shutting_down:
            raise shutting_down_error(self.counters)

    def _admit_pooled(self, num_reqs: int) -> None:
        """The gate of the decoder's pooled requests: the same as a generation's."""
        self.client.check_healthy()
        self._check_accepting()
        self._check_admission(num_reqs)

    def _check_admission(self, num_items: int) -> None:
        in_flight = (
            len(self.rid_to_state) + len(self.awaiting_echo) + len(self.embedding_manager.pending)
        )
        err = queue_full_error(
            in_flight, num_items, self.max_running_requests, self.args.max_queued_requests
        )
        if err is not None:
            self.counters.rejected["queue_full"] += 1
            raise err

    def _register(
        self, items: list[Item], obj: GenerateReqInput, tick: float | None
    ) -> list[ReqState]:
        for item in items:
            if item.rid in self.rid_to_state or item.rid in self.awaiting_echo:
                raise RequestError(f"a request with id {item.rid!r} is in flight", param="rid")
        updates = Updates(tick)
        group_rid = obj.rid if isinstance(obj.rid, str) else None
        states = [ReqState(it.rid, group_rid, it.index, updates) for it in items]
        for state in states:
            self.rid_to_state[state.rid] = state
        return states

    async def _build_reqs(
        self, items: list[Item], obj: GenerateReqInput, states: list[ReqState]
    ) -> list[TokenizedGenerateReqInput]:
        prompt_ids = await self._prompt_ids(items)
        session = _session_params(obj.session_params)
        param = "text" if obj.text is not None else "input_ids"
        prompts = await self._with_images(prompt_ids, obj, param)
        reqs = []
        for item, state in zip(items, states, strict=True):
            prompt = prompts[item.prompt_index]
            ids = prompt.input_ids
            self._validate_prompt(prompt.display_ids, param, obj)
            self._validate_logit_bias(item.params)
            if session is None or item.params.max_new_tokens is not None:
                # a session turn's prompt is built by the scheduler, which fills the default
                self._resolve_max_new_tokens(item, len(ids))
            state.prompt_ids, state.logprob_start_len = prompt.display_ids, obj.logprob_start_len
            state.meta["prompt_tokens"] = len(ids)
            reqs.append(
                TokenizedGenerateReqInput(
                    rid=item.rid, input_ids=ids, sampling_params=item.params,
                    return_logprob=obj.return_logprob, logprob_start_len=obj.logprob_start_len,
                    top_logprobs_num=obj.top_logprobs_num, stream=obj.stream,
                    session_params=session, timeout=obj.timeout, reply_to=self.client.reply_to,
                    grammar_after_id=obj.grammar_after_id,
                    reasoning_start_id=obj.reasoning_start_id, images=prompt.images,
                )
            )  # fmt: skip
        return reqs

    async def _with_images(
        self, prompt_ids: dict[int, list[int]], obj: GenerateReqInput, param: str
    ) -> dict[int, ExpandedPrompt]:
        """Every prompt with its images processed and its placeholders expanded
        (tokenizer/images.py); a text-only prompt as it is."""
        if self.images is None:
            if obj.image_data:
                raise RequestError("image_data: this model accepts text only", param="image_data")
            return {p: ExpandedPrompt(ids, ids, []) for p, ids in prompt_ids.items()}
        refs = image_data_per_prompt(obj.image_data, obj.num_prompts, obj.is_single)
        if obj.session_params is not None and any(refs):
            raise RequestError("images in session turns are not supported", param="image_data")
        images = await self.images.load([refs[p] for p in sorted(prompt_ids)])
        return {
            p: self.images.expand(prompt_ids[p], found, param)
            for p, found in zip(sorted(prompt_ids), images, strict=True)
        }

    async def _prompt_ids(self, items: list[Item]) -> dict[int, list[int]]:
        """Token ids of every distinct prompt, keyed by prompt index; texts encoded in a thread."""
        prompts = {it.prompt_index: it.prompt for it in items}
        texts = {p: t for p, t in prompts.items() if isinstance(t, str)}
        ids = {p: list(t) for p, t in prompts.items() if not isinstance(t, str)}
        if texts:
            size = sum(len(t) for t in texts.values())
            encoded = await self._run_short(size, self._encode_many, list(texts.values()))
            ids.update(zip(texts, encoded, strict=True))
        return ids

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        if len(texts) == 1:
            return [self.tokenizer.encode(texts[0])]
        return [list(x) for x in self.tokenizer(texts)["input_ids"]]

    def _validate_prompt(self, ids: list[int], param: str, obj: GenerateReqInput) -> None:
        if not ids:
            raise RequestError("the prompt is empty", param=param)
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise RequestError(
                f"token id {bad} is outside the vocabulary [0, {vocab})", param=param
            )
        if obj.return_logprob and obj.logprob_start_len > len(ids):
            raise RequestError(
                f"logprob_start_len {obj.logprob_start_len} is past the prompt ({len(ids)} tokens)",
                param="logprob_start_len",
            )

    def _validate_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.logit_bias or {} if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(
                f"logit_bias key {bad} is outside the vocabulary [0, {vocab})", param="logit_bias"
            )

    def _resolve_max_new_tokens(self, item: Item, prompt_len: int) -> None:
        """Checks prompt + completion against the context and the KV pool; fills an absent
        max_new_tokens with all the room there is."""
        params, ctx = item.params, self.context_len
        if params.max_new_tokens is None:
            if prompt_len >= ctx:
                raise _context_error(
                    f"This model's maximum context length is {ctx} tokens. However, your "
                    f"messages resulted in {prompt_len} tokens, which leaves no room for the "
                    "completion. Please reduce the length of the messages."
                )
            params.max_new_tokens = max(min(ctx, self.max_total_tokens) - prompt_len, 1)
        total = prompt_len + params.max_new_tokens
        if total > ctx:
            raise _context_error(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{total} tokens ({prompt_len} in the messages, {params.max_new_tokens} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        if total > self.max_total_tokens:
            raise RequestError(
                f"the request needs {total} tokens of KV cache but the server's pool holds "
                f"{self.max_total_tokens} (the server can raise --max-total-tokens)",
                param="max_new_tokens",
            )

    async def _wait(
        self, states: list[ReqState], stream: bool
    ) -> AsyncIterator[dict[str, Any] | None]:
        updates = states[0].updates
        remaining = len(states)
        while remaining:
            state = await updates.get()
            if state is None:  # a keep-alive tick
                yield None
                continue
            state.queued = False
            if state.finished:
                remaining -= 1
                yield output_dict(state)
            elif stream:
                yield output_dict(state)

    def _release(self, states: list[ReqState]) -> None:
        """The end of a generate_request call: whatever of it is unfinished was disconnected."""
        for state in states:
            if not state.finished:
                self.counters.count_abort("client_disconnect")
                self._end_here(state, "client")
            elif self.rid_to_state.get(state.rid) is state:
                del self.rid_to_state[state.rid]

    def _end_here(self, state: ReqState, cause: str) -> None:
        """Remove a live rid now; if the scheduler has it, abort it there and await the echo."""
        if self.rid_to_state.get(state.rid) is state:
            del self.rid_to_state[state.rid]
        if state.is_sent and self.is_healthy:
            self.awaiting_echo.add(state.rid)
            self.client.send_abort(AbortReq(rid=state.rid, reason=cause))

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort one request (its rid, or the rid the client gave a batch / n > 1 request) or
        all, in any phase; each finishes at once with finish_reason type "abort" and the
        output it had. Idempotent: an unknown or finished rid is ignored. Returns how many
        rids were aborted. `abort_all` ends the decoder's pooled requests too (499), counted as
        in EmbeddingManager.abort_all."""
        if not abort_all and not rid:
            raise RequestError("give a rid or abort_all", param="rid")
        states = [s for s in self.rid_to_state.values() if abort_all or rid in (s.rid, s.group_rid)]
        reason = aborted()
        for state in states:
            self.counters.count_abort("abort_request")
            self._finish_here(state, reason, "client")
        if not abort_all:
            return len(states)
        pooled = self.embedding_manager.abort_all(499, "request_aborted", "the request was aborted")
        return len(states) + pooled

    def begin_shutdown(self) -> None:
        """Refuse new requests, generation and pooled (`_admit_pooled`), with 503; those in
        flight go on."""
        self.shutting_down = True

    def abort_all_for_shutdown(self) -> int:
        """End every live rid, generation and pooled, with a 503 "shutdown" abort (the drain
        ran out of time)."""
        reason = shutdown()
        states = list(self.rid_to_state.values())
        for state in states:
            self.counters.count_abort("shutdown")
            self._finish_here(state, reason, "shutdown")
        pooled = self.embedding_manager.abort_all(503, "shutdown", SHUTDOWN_MESSAGE, "shutdown")
        return len(states) + pooled

    def _finish_here(self, state: ReqState, reason: FinishReason, cause: str) -> None:
        state.finish(reason)
        state.notify()
        self._end_here(state, cause)
        task = state.preparing
        if task is not None and not any(s.preparing is task for s in self.rid_to_state.values()):
            task.cancel()  # no item of its call is left: stop fetching and processing for it

    # ---- receiving (handlers of self.client's loop) ----------------------------------------

    def _handle_batch_output(self, out: BatchStrOutput) -> None:
        for i, rid in enumerate(out.rids):
            state = self.rid_to_state.get(rid)
            if state is None:
                self._on_stray_output(rid, out.finished_reasons[i] is not None)
                continue
            merge_update(state, out, i)
            if state.finished:
                del self.rid_to_state[rid]
                self.counters.count_finish(state.meta["finish_reason"])
            state.notify()

    def _on_stray_output(self, rid: str, finished: bool) -> None:
        """An output for a rid without a state: expected (up to its finish) for a rid ended
        here, a zombie otherwise."""
        if rid in self.awaiting_echo:
            if finished:
                self.awaiting_echo.discard(rid)
        else:
            self.counters.unknown_rid_outputs += 1

    # ---- other services -------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        image_token = None if self.images is None else self.images.image_token
        return chat.apply_chat_template(
            self.tokenizer, messages, tools, chat_template_kwargs, add_generation_prompt,
            image_token,
        )  # fmt: skip

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise RequestError("the text to tokenize must be a string", param="prompt")
        return await self._run_short(
            len(text), lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        )

    async def detokenize(self, ids: list[int]) -> str:
        size = len(self.tokenizer)
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < size for t in ids):
            bad = next((t for t in ids if not (type(t) is int and 0 <= t < size)), ids)
            raise RequestError(
                f"token id {bad!r} is outside the vocabulary [0, {size})", param="tokens"
            )
        return await self._run(self.tokenizer.decode, ids)

    async def get_internal_state(self) -> dict[str, Any]:
        """Every process's view: the scheduler's queues and KV pool, the detokenizer's states
        and this process's rids (live ones and those awaiting an abort echo)."""
        reply = await self.client.control(GetInternalStateReq(), InternalStateReply)
        state = msgspec.structs.asdict(reply.state)
        state["num_req_states"] = self.num_req_states()
        state["num_detokenizer_states"] = reply.num_detokenizer_states
        state["kv_pool"] = {
            "total": state["kv_total"], "free": state["kv_free"],
            "cached": state["kv_cached"], "in_use": state["kv_in_use"],
        }  # fmt: skip
        return state

    def num_req_states(self) -> int:
        """Rids this process holds: live ones, those awaiting an abort echo, pooled ones."""
        return (
            len(self.rid_to_state) + len(self.awaiting_echo) + len(self.embedding_manager.pending)
        )

    async def open_session(
        self, session_id: str | None = None, timeout: float = 0.0, capacity_of_str_len: int = 0
    ) -> str:
        """Open a session in the scheduler (a random id when none is given); returns its id.
        Raises RequestError (400) when the scheduler refuses it (e.g. the id is open)."""
        sid = session_id or uuid.uuid4().hex
        msg = OpenSessionReq(sid, float(timeout or 0.0), int(capacity_of_str_len or 0))
        reply = await self.client.control(msg, OpenSessionReply)
        if not reply.success:
            raise RequestError(f"failed to open the session: {reply.message}", param="session_id")
        return reply.session_id

    def close_session(self, session_id: str) -> None:
        """Fire and forget; a turn sent after this call is rejected (one ordered socket)."""
        self.client.check_healthy()
        self.client.send(CloseSessionReq(session_id))

    def set_paused(self, paused: bool) -> None:
        """Fire and forget, ordered with the requests sent after it (one socket)."""
        self.client.check_healthy()
        self.client.send(SetPausedReq(paused))

    async def flush_cache(self) -> bool:
        """True if the radix cache was emptied; False (nothing done) while requests run."""
        reply = await self.client.control(FlushCacheReq(), FlushCacheReply)
        return reply.success

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _run_short(self, num_chars: int, fn: Any, *args: Any) -> Any:
        """`_run`, or on the loop itself for text of `num_chars` up to INLINE_MAX_CHARS while the
        tokenizer thread is idle (tokenizer_thread.py: the two never overlap)."""
        if num_chars <= INLINE_MAX_CHARS and self._executor.is_idle():
            return fn(*args)
        return await self._run(fn, *args)


def _prepared(
    task: asyncio.Future[list[TokenizedGenerateReqInput]], states: list[ReqState]
) -> list[TokenizedGenerateReqInput] | None:
    """The requests `task` built (its error raised here); None when it was cancelled."""
    for state in states:
        state.preparing = None
    return None if task.cancelled() else task.result()


def _session_params(params: dict[str, Any] | None) -> SessionParams | None:
    if params is None:
        return None
    try:
        session = msgspec.convert(params, SessionParams, strict=False)
    except msgspec.ValidationError as e:
        raise RequestError(f"invalid session_params: {e}", param="session_params") from e
    if session.offset is not None:
        check_int("session_params.offset", session.offset, 0)
    return session


def _context_error(message: str) -> RequestError:
    return RequestError(message, code="context_length_exceeded", param="messages")
