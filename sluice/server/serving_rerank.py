"""POST /v1/rerank and /rerank (the Cohere/Jina shape; OpenAI has no rerank API).

`{model, query, documents: [str | {text}], top_n, return_documents}` →
`{id, model, method, results: [{index, relevance_score, document?}], usage}`, results sorted by
score, highest first. The model scores each document in one of three ways; without `model`,
the first the server can: a cross-encoder scores each (query, document) pair: `method`
"cross-encoder". An embedding model embeds the query and the documents and the score is their
cosine similarity: `method` "cosine". The chat model (a decoder) is asked, through its chat
template, whether the document answers the query, and the score is p(yes) / (p(yes) + p(no))
of its next token: `method` "decoder-yes-no".
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from sluice.server.errors import APIError, error_response
from sluice.server.protocol import Positive
from sluice.server.serving_base import ServingContext, new_rid, parse_body, run_until_disconnect
from sluice.server.serving_embedding import pick_model
from sluice.server.serving_score import label_probabilities
from sluice.tokenizer import chat

# routing without `model`: a cross-encoder, else an embedding model (cosine), else the decoder
RERANK_PREFERENCE = ("rerank", "embed", "generate")
RERANK_SYSTEM_PROMPT = 'Judge whether the document answers the query. Answer only "yes" or "no".'


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: Positive | None = None
    return_documents: bool = True


def rerank_prompt(tokenizer: Any, query: str, document: str) -> str:
    """The decoder's chat prompt asking whether `document` answers `query`, up to the start of
    the assistant's turn."""
    messages = [
        {"role": "system", "content": RERANK_SYSTEM_PROMPT},
        {"role": "user", "content": f"Query: {query}\nDocument: {document}"},
    ]
    return chat.apply_chat_template(tokenizer, messages, add_generation_prompt=True)


def rerank_prompt_ids(
    tokenizer: Any, query: str, documents: list[str], context_len: int
) -> list[list[int]]:
    """The token ids of each document's rerank prompt (the template already holds any BOS), the
    document cut to fit `context_len`; a query too long to leave room for any is a 400. Runs in
    the tokenizer thread."""

    def encode(document: str) -> list[int]:
        text = rerank_prompt(tokenizer, query, document)
        return tokenizer.encode(text, add_special_tokens=False)

    room = context_len - len(encode(""))
    if room <= 0:
        raise APIError(
            400, f"the query does not fit this model's context of {context_len} tokens",
            "context_length_exceeded", "query",
        )  # fmt: skip
    prompts = []
    for document in documents:
        doc_ids = tokenizer.encode(document, add_special_tokens=False)
        keep = min(len(doc_ids), room)
        prompt = encode(document if keep == len(doc_ids) else tokenizer.decode(doc_ids[:keep]))
        while len(prompt) > context_len and keep > 0:  # the cut text may tokenize longer
            keep = max(keep - (len(prompt) - context_len), 0)
            prompt = encode(tokenizer.decode(doc_ids[:keep]))
        prompts.append(prompt)
    return prompts


def yes_no_token_ids(tokenizer: Any) -> list[int]:
    """The single-token ids of "yes" and "no" (or " yes" and " no") in `tokenizer`."""
    ids = []
    for word in ("yes", "no"):
        for text in (word, f" {word}"):
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == 1:
                ids.append(int(encoded[0]))
                break
        else:
            raise APIError(
                400, f"this model's tokenizer has no single token for {word!r}: it cannot rerank",
                "invalid_request_error", "model",
            )  # fmt: skip
    return ids


class ServingRerank:
    """`models`: the pooled models (encoders, then the decoder's manager if any)."""

    def __init__(self, ctx: ServingContext, models: list[Any]) -> None:
        self.ctx, self.models = ctx, models
        # found once, before serving: the tokenizer is not called on the event loop
        self._yes_no: list[int] | APIError | None = None
        decoder = next((m for m in models if m.is_decoder), None)
        if decoder is not None:
            try:
                self._yes_no = yes_no_token_ids(decoder.tokenizer)
            except APIError as e:
                self._yes_no = e

    async def handle(self, raw_request: Request) -> Response:
        try:
            req = await parse_body(raw_request, RerankRequest)
            encoder = pick_model(self.ctx, self.models, req.model, "rerank", RERANK_PREFERENCE)
            if not req.query.strip():
                raise APIError(400, "query must not be empty", "invalid_request_error", "query")
            if not req.documents:
                raise APIError(
                    400, "documents must not be empty", "invalid_request_error", "documents"
                )
            return await run_until_disconnect(raw_request, self._respond(req, encoder))
        except Exception as exc:
            return error_response(exc)

    async def _respond(self, req: RerankRequest, encoder: Any) -> Response:
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        if encoder.task == "rerank":
            scores, num_tokens = await encoder.score_pairs(req.query, texts)
            method = "cross-encoder"
        elif encoder.is_decoder:
            scores, num_tokens = await self._decoder_scores(encoder, req.query, texts)
            method = "decoder-yes-no"
        else:
            scores, num_tokens = await _cosine_scores(encoder, req.query, texts)
            method = "cosine"
        order = sorted(range(len(texts)), key=lambda i: scores[i], reverse=True)
        results = []
        for i in order[: req.top_n or len(order)]:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        body = {
            "id": f"rerank-{new_rid()}",
            "model": encoder.model_name,
            "method": method,
            "results": results,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
        return JSONResponse(body)

    async def _decoder_scores(
        self, decoder: Any, query: str, texts: list[str]
    ) -> tuple[list[float], int]:
        if isinstance(self._yes_no, APIError):
            raise self._yes_no
        assert self._yes_no is not None  # found at start for the one decoder
        prompts = await decoder.tokenize_for_call(
            rerank_prompt_ids, decoder.tokenizer, query, texts, decoder.context_len
        )
        logprobs, num_tokens = await decoder.score_labels(prompts, self._yes_no, "documents")
        return [label_probabilities(lp, apply_softmax=True)[0] for lp in logprobs], num_tokens


async def _cosine_scores(encoder: Any, query: str, texts: list[str]) -> tuple[list[float], int]:
    for text in texts:
        if not text.strip():
            raise APIError(
                400, "documents must not be empty strings", "invalid_request_error", "documents"
            )
    vectors, num_tokens = await encoder.embed([query, *texts], encoder.context_len)
    matrix = np.stack(vectors).astype(np.float32)  # [1 + documents, dim]
    matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
    return [float(s) for s in matrix[1:] @ matrix[0]], num_tokens
