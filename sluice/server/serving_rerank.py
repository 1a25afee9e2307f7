"""POST /v1/rerank and /rerank (the Cohere/Jina shape; OpenAI has no rerank API).

`{model, query, documents: [str | {text}], top_n, return_documents}` →
`{id, model, method, results: [{index, relevance_score, document?}], usage}`, results sorted by
score, highest first. A cross-encoder scores each (query, document) pair when the server has one
(or the request names it): `method` "cross-encoder". Otherwise an embedding model embeds the
query and the documents and the score is their cosine similarity: `method` "cosine".
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from sluice.server.errors import APIError, error_response
from sluice.server.serving_base import ServingContext, new_rid, parse_body, run_until_disconnect
from sluice.server.serving_embedding import pick_encoder


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


class ServingRerank:
    def __init__(self, ctx: ServingContext, encoders: list[Any]) -> None:
        self.ctx, self.encoders = ctx, encoders

    async def handle(self, raw_request: Request) -> Response:
        try:
            req = await parse_body(raw_request, RerankRequest)
            encoder = pick_encoder(self.ctx, self.encoders, req.model, ("rerank", "embed"))
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
