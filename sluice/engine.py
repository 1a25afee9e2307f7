"""Engine: the scheduler, in-process, for offline batch use and tests.

It runs the same Scheduler and DetokenizerManager code as the server, without processes or
sockets: `generate` tokenizes, hands TokenizedGenerateReqInput messages to the scheduler, steps it
until its requests finish, and detokenizes the BatchTokenIDOutput it emits. `encode` (last-token
embeddings) and `score` (label-token probabilities) send TokenizedEmbeddingReqInput messages and
read the BatchEmbeddingOutput the scheduler emits for them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import msgspec
import numpy as np
import torch

from sluice.checkpoint.hf_dir import load_model_config
from sluice.checkpoint.vision import ImageSlots
from sluice.config import ServerArgs
from sluice.detokenizer.manager import DetokenizerManager
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from sluice.scheduler.resources import resolve_resources
from sluice.scheduler.scheduler import Scheduler
from sluice.tokenizer import normalize
from sluice.tokenizer.images import ExpandedPrompt, PromptImages, image_data_per_prompt
from sluice.tokenizer.normalize import RequestError
from sluice.utils.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]


def parse_sampling_params(params: dict[str, Any] | None) -> SamplingParams:
    """A SamplingParams from a plain dict (unknown keys are an error, as are wrong types, more
    than one grammar and a JSON schema that is not JSON)."""
    params = dict(params or {})
    unknown = set(params) - set(SamplingParams.__struct_fields__)
    if unknown:
        raise ValueError(f"unknown sampling parameters: {', '.join(sorted(unknown))}")
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    if params.get("logit_bias"):
        params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"].items()}
    try:
        normalize.check_grammar(params)
    except normalize.RequestError as e:
        raise ValueError(e.message) from None
    return msgspec.convert(params, SamplingParams)


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        self.args = ServerArgs(model_path=model_path, **server_args)
        self.model_config = load_model_config(self.args.model_path)
        self.tokenizer = get_tokenizer(self.model_config.hf_dir)
        self.resources = resolve_resources(self.args, self.model_config)
        torch.set_num_threads(self.resources.num_threads)
        self.scheduler = Scheduler(self.args, self.model_config, self.tokenizer, self.resources)
        self.detokenizer = DetokenizerManager.with_pieces(self.tokenizer)
        self._ids = itertools.count()
        self._images: PromptImages | None = None  # made at the first image_data

    def generate(
        self,
        prompt: Prompt | list[Prompt] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        image_data: str | list[Any] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a list of prompts (a list back).

        A prompt is text or a list of token ids; `sampling_params` is one dict for all prompts
        or one per prompt. `image_data` (a vision-language model): image URLs or data: URIs as
        on /generate, one `<image>` token in the prompt where each goes.
        """
        prompts, single = self._normalize(prompt, input_ids)
        expanded = self._with_images(prompts, image_data, single)
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        rids = []
        for prompt_in, p in zip(expanded, params, strict=True):
            rid = f"engine-{next(self._ids)}"
            rids.append(rid)
            self.scheduler.add_request(
                TokenizedGenerateReqInput(
                    rid=rid, input_ids=prompt_in.input_ids, images=prompt_in.images,
                    sampling_params=parse_sampling_params(p), return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                )
            )  # fmt: skip
        results = self._run_until_done(rids)
        out = [results[r] for r in rids]
        return out[0] if single else out

    def encode(
        self, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Embed one prompt (a dict back; a list of ints is one prompt) or a list of prompts (a
        list back): {"embedding": [floats], "meta_info": {...}}, the L2-normalized final-norm
        hidden state of the last prompt token. An aborted prompt has an empty embedding and
        its reason in meta_info["finish_reason"]."""
        prompts, single = self._normalize(prompt, None)
        results = self._run_pooled(self._add_pooled(prompts, None))
        return results[0] if single else results

    def score(
        self,
        query: str | list[int],
        items: list[str] | list[list[int]],
        label_token_ids: list[int],
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """Per item, the probabilities of `label_token_ids` as the next token after query + item
        (item + query when `item_first`; texts are joined before tokenizing, ids as lists).
        apply_softmax: a softmax over just the label tokens' logits; else each label's
        probability in the full-vocabulary distribution. ValueError if an item fails."""
        if not label_token_ids:
            raise ValueError("label_token_ids is empty")
        if not items:
            return []
        results = self._run_pooled(
            self._add_pooled(self._score_prompts(query, items, item_first), label_token_ids)
        )
        for res in results:
            reason = res["meta_info"]["finish_reason"]
            if reason["type"] == "abort":
                raise ValueError(f"scoring failed: {reason.get('message')}")
        logprobs = torch.tensor([r["embedding"] for r in results], dtype=torch.float64)
        probs = torch.softmax(logprobs, dim=-1) if apply_softmax else logprobs.exp()
        return probs.tolist()

    def _score_prompts(
        self, query: str | list[int], items: list[str] | list[list[int]], item_first: bool
    ) -> list[list[int]]:
        """query + item (item + query when item_first): texts joined, then tokenized."""
        is_text = isinstance(query, str)
        if not all(isinstance(it, str) == is_text for it in items):
            raise ValueError("query and items must be all text or all token ids")
        pairs: list[Any] = [(it, query) if item_first else (query, it) for it in items]
        if is_text:
            return [self.tokenizer.encode(a + b) for a, b in pairs]
        return [list(a) + list(b) for a, b in pairs]

    def _add_pooled(self, prompts: list[list[int]], label_token_ids: list[int] | None) -> list[str]:
        rids = []
        for ids in prompts:
            rid = f"engine-{next(self._ids)}"
            rids.append(rid)
            self.scheduler.add_embedding_request(
                TokenizedEmbeddingReqInput(rid=rid, input_ids=ids, label_token_ids=label_token_ids)
            )
        return rids

    def _run_pooled(self, rids: list[str]) -> list[dict[str, Any]]:
        results: dict[str, dict[str, Any]] = {}
        self._drive(set(rids), {}, results)
        return [results[r] for r in rids]

    def abort(self, rid: str) -> None:
        self.scheduler.abort(AbortReq(rid=rid))

    def _normalize(
        self, prompt: Prompt | list[Prompt] | None, input_ids: list[int] | list[list[int]] | None
    ) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        items: Any = prompt if prompt is not None else input_ids
        single = isinstance(items, str) or (bool(items) and isinstance(items[0], int))
        items = [items] if single else list(items)
        if not items:
            raise ValueError("no prompt given")
        return [self._encode(x) for x in items], single

    def _with_images(
        self, prompts: list[list[int]], image_data: Any, single: bool
    ) -> list[ExpandedPrompt]:
        """The prompts with their images processed and placeholders expanded (as the server's
        TokenizerManager does); raises ValueError for images it will not take."""
        if image_data is None:
            return [ExpandedPrompt(ids, ids, []) for ids in prompts]
        try:
            if self._images is None:
                slots = ImageSlots.of(self.model_config)
                if slots is None:
                    raise RequestError("image_data: this model accepts text only")
                self._images = PromptImages(self.args, self.model_config, slots, self.tokenizer)
            refs = image_data_per_prompt(image_data, len(prompts), single)
            loaded = asyncio.run(self._load_images(self._images, refs))
            return [
                self._images.expand(ids, found, "prompt")
                for ids, found in zip(prompts, loaded, strict=True)
            ]
        except RequestError as e:
            raise ValueError(e.message) from None

    @staticmethod
    async def _load_images(images: PromptImages, refs: list[list[str]]) -> list[Any]:
        try:
            return await images.load(refs)
        finally:
            await images.media.fetcher.close()  # its HTTP session belongs to this event loop

    def _encode(self, p: Prompt) -> list[int]:
        return self.tokenizer.encode(p) if isinstance(p, str) else list(p)

    def _run_until_done(self, rids: list[str]) -> dict[str, dict[str, Any]]:
        results = {r: {"text": "", "output_ids": [], "meta_info": {"id": r}} for r in rids}
        self._drive(set(rids), results, {})
        return results

    def _drive(
        self,
        pending: set[str],
        results: dict[str, dict[str, Any]],
        pooled: dict[str, dict[str, Any]],
    ) -> None:
        """Step the scheduler until every rid in `pending` finished; generation outputs merge
        into `results` (rids not there are dropped), pooled ones into `pooled`."""
        while pending:
            out = self.scheduler.step()
            emb = self.scheduler.take_embedding_output()
            if out is None and emb is None and not self.scheduler.has_work():
                raise RuntimeError(f"scheduler went idle with {len(pending)} requests pending")
            if out is not None:
                self._merge(self.detokenizer.handle(out), results, pending)
            if emb is not None:
                self._merge_pooled(emb, pooled, pending)

    @staticmethod
    def _merge_pooled(
        out: BatchEmbeddingOutput, results: dict[str, dict[str, Any]], pending: set[str]
    ) -> None:
        for i, rid in enumerate(out.rids):
            if rid not in pending:
                continue
            meta = {
                "id": rid, "prompt_tokens": out.prompt_tokens[i],
                "cached_tokens": out.cached_tokens[i] if out.cached_tokens else 0,
                "finish_reason": msgspec.to_builtins(out.finished_reasons[i]),
            }  # fmt: skip
            vector = np.frombuffer(out.embeddings[i], dtype="<f4").tolist()
            results[rid] = {"embedding": vector, "meta_info": meta}
            pending.discard(rid)

    @staticmethod
    def _merge(out: BatchStrOutput, results: dict[str, dict[str, Any]], pending: set[str]) -> None:
        for i, rid in enumerate(out.rids):
            res = results.get(rid)
            if res is None:
                continue
            res["text"] += out.texts[i]
            res["output_ids"].extend(out.new_token_ids[i])
            meta = res["meta_info"]
            meta.update(
                prompt_tokens=out.prompt_tokens[i], completion_tokens=out.completion_tokens[i],
                cached_tokens=out.cached_tokens[i],
            )  # fmt: skip
            if out.output_token_logprobs[i]:
                meta.setdefault("output_token_logprobs", []).extend(out.output_token_logprobs[i])
                meta.setdefault("output_top_logprobs", []).extend(
                    msgspec.to_builtins(out.output_top_logprobs[i])
                )
            if out.input_token_logprobs[i]:
                meta.setdefault("input_token_logprobs", []).extend(out.input_token_logprobs[i])
                meta.setdefault("input_top_logprobs", []).extend(
                    msgspec.to_builtins(out.input_top_logprobs[i])
                )
            reason = out.finished_reasons[i]
            if reason is not None:
                meta["finish_reason"] = msgspec.to_builtins(reason)
                pending.discard(rid)

    def shutdown(self) -> None:
        """Release the model and the KV pool (and the image workers, if any were started)."""
        self.scheduler = None  # type: ignore[assignment]
        if self._images is not None:
            asyncio.run(self._images.close())
            self._images = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
