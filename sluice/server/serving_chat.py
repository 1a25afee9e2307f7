"""POST /v1/chat/completions: ChatCompletionRequest → GenerateReqInput, and back to OpenAI.

Streaming shape per choice: a role chunk (`{"role": "assistant", "content": ""}`), content
chunks (and reasoning and tool-call chunks, `chat_output.py`), then one chunk with an empty
delta and the finish_reason; `finish_reason` is null on every other chunk, and "tool_calls"
when the choice called tools.

Tools: the chat template renders them (or sluice's fallback prompt, for templates that do not);
`tool_choice` "required" or a named function is enforced by a grammar of the model family's
call format (`tool_grammar.py`), "auto" is the model's choice. With a reasoning parser, a
grammar applies from the end of the reasoning on.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from sluice.server.chat_output import ChatParsers
from sluice.server.errors import APIError
from sluice.server.logprobs import chat_logprobs
from sluice.server.protocol import ChatCompletionRequest
from sluice.server.serving_base import OpenAIServingBase, ResponseState, finish_reason, new_rid
from sluice.server.sse import sse_data
from sluice.server.tool_grammar import forced_call_grammar
from sluice.server.tool_parser import MARKERS
from sluice.tokenizer import chat
from sluice.tokenizer.generate_input import GenerateReqInput

CHUNK = "chat.completion.chunk"


class OpenAIServingChat(OpenAIServingBase):
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl-"

    async def convert(self, req: ChatCompletionRequest) -> GenerateReqInput:
        try:
            messages = req.template_messages()
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error", "messages") from None
        tools = req.tool_dicts()
        text = self.tm.apply_chat_template(
            messages,
            tools=tools,
            chat_template_kwargs=req.chat_template_kwargs,
            add_generation_prompt=req.add_generation_prompt,
        )
        # the template already holds the special tokens (BOS, role markers): add none again
        input_ids = await self.tm.tokenize(text, add_special_tokens=False)
        image_urls = chat.image_urls(messages)  # in the order of their placeholders in `text`
        parsers = self._parsers(req)
        params = req.sampling_params()
        if req.forced_tool is not None:
            params["ebnf"] = forced_call_grammar(
                self.ctx.tool_parser, tools or [], req.forced_tool,
                req.parallel_tool_calls is not False, self._special_id,
            )  # fmt: skip
        if any(self._special_id(m) is not None for m in self._markers(parsers)):
            params["skip_special_tokens"] = False  # the parsers must see their markers
        after_id, start_id = self._grammar_after(parsers, params)
        return GenerateReqInput(
            input_ids=input_ids,
            sampling_params=params,
            grammar_after_id=after_id,
            reasoning_start_id=start_id,
            rid=req.rid or new_rid(),
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            stream=req.stream,
            timeout=req.timeout or 0.0,
            session_params=req.session_params,
            image_data=image_urls or None,
        )

    def _parsers(self, req: ChatCompletionRequest) -> ChatParsers:
        return ChatParsers.for_request(
            self.ctx.reasoning_parser, self.ctx.tool_parser, req.tool_names(),
            req.chat_template_kwargs, max_calls=1 if req.parallel_tool_calls is False else None,
        )  # fmt: skip

    def _markers(self, parsers: ChatParsers) -> list[str]:
        """The texts the request's parsers look for in the output."""
        out = list(MARKERS[self.ctx.tool_parser]) if parsers.tools is not None else []
        if parsers.reasoning is not None:
            out += [parsers.reasoning.start, parsers.reasoning.end]
        return out

    @cached_property
    def _added_vocab(self) -> dict[str, int]:
        return self.tm.tokenizer.get_added_vocab()

    def _special_id(self, text: str) -> int | None:
        """The id of `text` when it is one added (special) token of the tokenizer."""
        return self._added_vocab.get(text)

    def _grammar_after(self, parsers: ChatParsers, params: dict[str, Any]) -> tuple[int, int]:
        """With reasoning and a grammar: the token that ends the reasoning (the grammar and
        stopping wait for it), and the one that opens it when the model may skip it (-1 when
        the template opens it); else (-1, -1)."""
        reasoning = parsers.reasoning
        if reasoning is None or not any(k in params for k in ("json_schema", "regex", "ebnf")):
            return -1, -1
        tags = [reasoning.end] + ([] if reasoning.starts_in_reasoning else [reasoning.start])
        ids = [self._special_id(tag) for tag in tags]
        for tag, token in zip(tags, ids, strict=True):
            if token is None:
                raise APIError(
                    400, f"this tokenizer has no single token {tag!r} that delimits the "
                    "reasoning, so the output cannot be constrained after it",
                    "invalid_request_error", "response_format",
                )  # fmt: skip
        return ids[0], ids[1] if len(ids) > 1 else -1

    def new_state(self, req: ChatCompletionRequest, obj: GenerateReqInput) -> ResponseState:
        state = super().new_state(req, obj)
        state.extra["logprobs"] = req.logprobs
        parsers = self._parsers(req)
        state.extra["parsers"] = parsers
        state.extra["plain"] = parsers.reasoning is None and parsers.tools is None
        state.extra["streams"] = {}  # index -> ChoiceStream
        return state

    def _logprobs(self, meta: dict[str, Any], start: int = 0) -> dict[str, Any]:
        pairs = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        return chat_logprobs(self.ctx.token_text, pairs[start:], tops[start:])

    def stream_frames(self, state: ResponseState, item: dict[str, Any]) -> list[str]:
        index, meta = item["index"], item["meta_info"]
        frames = []
        if index not in state.started:
            state.started.add(index)
            frames.append(self._chunk(state, index, {"role": "assistant", "content": ""}))
        logprobs = None
        if state.extra["logprobs"] and item.get("new_logprob_count"):
            num_seen = len(meta.get("output_token_logprobs") or []) - item["new_logprob_count"]
            logprobs = self._logprobs(meta, num_seen)
        reason = finish_reason(meta)
        deltas = self._deltas(state, index, item["delta"], reason is not None)
        if logprobs is not None and not deltas:
            deltas = [{"content": ""}]
        for i, delta in enumerate(deltas):
            frames.append(self._chunk(state, index, delta, logprobs=logprobs if i == 0 else None))
        if reason is not None:
            matched = meta["finish_reason"].get("matched")
            stream = state.extra["streams"].get(index)
            if reason == "stop" and stream is not None and stream.has_tool_calls:
                reason = "tool_calls"
            frames.append(self._chunk(state, index, {}, reason=reason, matched=matched))
        return frames

    def _deltas(self, state: ResponseState, index: int, text: str, final: bool) -> list[dict]:
        """The OpenAI deltas of a text delta: as content, or through the choice's parsers."""
        if state.extra["plain"]:
            return [{"content": text}] if text else []
        stream = state.extra["streams"].get(index)
        if stream is None:
            stream = state.extra["streams"][index] = state.extra["parsers"].stream()
        deltas = stream.feed(text) if text else []
        return deltas + stream.finish() if final else deltas

    def _chunk(
        self,
        state: ResponseState,
        index: int,
        delta: dict[str, Any],
        *,
        logprobs: dict[str, Any] | None = None,
        reason: str | None = None,
        matched: int | str | None = None,
    ) -> str:
        if logprobs is None and reason is None and len(delta) == 1 and "content" in delta:
            content = delta["content"]
            if isinstance(content, str):  # the frame of nearly every token
                body = lambda t: self._body(state, index, {"content": t})  # noqa: E731
                return state.text_frame(index, content, body)
        return sse_data(self._body(state, index, delta, logprobs, reason, matched))

    def _body(
        self,
        state: ResponseState,
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        reason: str | None = None,
        matched: int | str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": reason,
        }
        if reason is not None:
            choice["matched_stop"] = matched
        body = self.chunk_head(state, CHUNK)
        body["choices"] = [choice]
        if state.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, state: ResponseState, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self.chunk_head(state, CHUNK), "choices": [], "usage": usage}

    def final_response(self, state: ResponseState, items: list[dict[str, Any]]) -> dict[str, Any]:
        choices = [self._choice(state, item) for item in items]
        return {
            **self.chunk_head(state, "chat.completion"),
            "choices": choices,
            "usage": state.usage(),
        }

    def _choice(self, state: ResponseState, item: dict[str, Any]) -> dict[str, Any]:
        meta = item["meta_info"]
        reason = finish_reason(meta)
        message, has_calls = state.extra["parsers"].message(item["text"])
        if reason == "stop" and has_calls:
            reason = "tool_calls"
        return {
            "index": item["index"],
            "message": message,
            "logprobs": self._logprobs(meta) if state.extra["logprobs"] else None,
            "finish_reason": reason,
            "matched_stop": (meta.get("finish_reason") or {}).get("matched"),
        }
