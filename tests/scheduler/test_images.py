"""Requests with images through the scheduler (tiny LLaVA, float32): greedy tokens equal
transformers', a repeated image is served from the prefix cache without encoding it again, a
prefill chunk may cut through an image, prompt logprobs and penalties skip image positions, and
a malformed image ends only its own request with a 400."""

from __future__ import annotations

import io
import itertools
from typing import Any

import numpy as np
import pytest
import torch

from sluice.checkpoint.model_config import ModelConfig
from sluice.checkpoint.vision import ImageSlots
from sluice.engine import Engine, parse_sampling_params
from sluice.messages import ImageItem, TokenizedGenerateReqInput
from sluice.tokenizer.images import expand_images
from sluice.tokenizer.media.process import ProcessedImage
from tests.tiny_models import make_tiny_llava

_rids = itertools.count()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("tiny_llava"), tokenizer_dir=smollm2_hf_dir)


@pytest.fixture(scope="module")
def processor(llava_dir: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def hf_model(llava_dir: str) -> Any:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(make_engine: Any, llava_dir: str) -> Engine:
    return make_engine(llava_dir, max_total_tokens=2048)


def _image(seed: int, size: tuple[int, int] = (40, 48)) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


class Prompt:
    """A prompt with images as the HTTP process builds it, and transformers' inputs for it."""

    def __init__(self, processor: Any, llava_dir: str, text: str, images: list[Any]) -> None:
        cfg = ModelConfig.from_hf_dir(llava_dir)
        slots = ImageSlots.of(cfg)
        assert slots is not None
        self.hf = processor(text=text, images=images, return_tensors="pt")
        ids = processor.tokenizer(text)["input_ids"]
        processed = [
            ProcessedImage(f"{seed:064x}", pv.numpy())
            for seed, pv in zip(_hashes(images), self.hf["pixel_values"], strict=True)
        ]
        self.expanded = expand_images(ids, processed, slots, cfg.vocab_size, "text")
        assert self.expanded.display_ids == self.hf["input_ids"][0].tolist()


def _hashes(images: list[Any]) -> list[int]:
    """A stand-in content hash per image: the same pixels, the same number."""
    out = []
    for image in images:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        out.append(hash(buf.getvalue()) & (2**256 - 1))
    return out


def run(engine: Engine, ids: list[int], images: list[ImageItem], **params: Any) -> dict:
    rid = f"img-{next(_rids)}"
    extra = {k: params.pop(k) for k in ("return_logprob", "logprob_start_len") if k in params}
    sampling = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True, **params}
    engine.scheduler.add_request(
        TokenizedGenerateReqInput(
            rid=rid, input_ids=ids, sampling_params=parse_sampling_params(sampling),
            images=images, **extra,
        )
    )  # fmt: skip
    return engine._run_until_done([rid])[rid]


def _hf_greedy(hf_model: Any, prompt: Prompt, num: int = 8) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(**prompt.hf, max_new_tokens=num, do_sample=False)
    return out[0, prompt.hf["input_ids"].shape[1] :].tolist()


def _count_encoded(engine: Engine) -> list[int]:
    """Images encoded by the vision tower, appended per call."""
    model = engine.scheduler.runner.model
    calls: list[int] = []
    encode = model.image_features

    def counting(pixel_values: torch.Tensor) -> torch.Tensor:
        calls.append(pixel_values.shape[0])
        return encode(pixel_values)

    model.image_features = counting
    return calls


def test_greedy_tokens_equal_transformers(engine, processor, hf_model, llava_dir) -> None:
    three = [_image(1), _image(2), _image(3, (64, 40))]
    for text, images in [
        ("USER: <image>\nWhat is this? ASSISTANT:", [_image(0)]),
        ("USER: <image><image> Compare, then <image>. ASSISTANT:", three),
    ]:
        prompt = Prompt(processor, llava_dir, text, images)
        out = run(engine, prompt.expanded.input_ids, prompt.expanded.images)
        assert out["output_ids"] == _hf_greedy(hf_model, prompt)


def test_a_repeated_image_hits_the_prefix_cache_without_encoding(
    engine, processor, llava_dir
) -> None:
    calls = _count_encoded(engine)
    try:
        prompt = Prompt(processor, llava_dir, "<image>\nDescribe it in detail:", [_image(4)])
        first = run(engine, prompt.expanded.input_ids, prompt.expanded.images)
        second = run(engine, prompt.expanded.input_ids, prompt.expanded.images)
    finally:
        del engine.scheduler.runner.model.image_features
    assert calls == [1]  # the second request's image positions all came from the cache
    assert second["output_ids"] == first["output_ids"]
    prompt_len = len(prompt.expanded.input_ids)
    assert second["meta_info"]["cached_tokens"] == prompt_len - 1


def test_a_chunk_cut_through_an_image_gives_the_same_tokens(
    make_engine, engine, processor, llava_dir
) -> None:
    chunked = make_engine(llava_dir, max_total_tokens=2048, chunked_prefill_size=7)
    prompt = Prompt(processor, llava_dir, "Look: <image> and <image>?", [_image(5), _image(6)])
    want = run(engine, prompt.expanded.input_ids, prompt.expanded.images)["output_ids"]
    calls = _count_encoded(chunked)
    try:
        got = run(chunked, prompt.expanded.input_ids, prompt.expanded.images)["output_ids"]
    finally:
        del chunked.scheduler.runner.model.image_features
    assert got == want
    assert calls == [1, 1]  # the chunks after an image's first took its features from the cache


def test_without_the_feature_cache_every_chunk_encodes_its_images(
    make_engine, engine, processor, llava_dir
) -> None:
    uncached = make_engine(
        llava_dir, max_total_tokens=2048, chunked_prefill_size=7, image_feature_cache_mb=0
    )
    prompt = Prompt(processor, llava_dir, "Look: <image> and <image>?", [_image(5), _image(6)])
    want = run(engine, prompt.expanded.input_ids, prompt.expanded.images)["output_ids"]
    calls = _count_encoded(uncached)
    try:
        got = run(uncached, prompt.expanded.input_ids, prompt.expanded.images)["output_ids"]
    finally:
        del uncached.scheduler.runner.model.image_features
    assert got == want
    assert sum(calls) > 2  # each image was encoded by every chunk that cut it


def test_a_repeated_image_after_other_text_skips_the_vision_tower(
    engine, processor, hf_model, llava_dir
) -> None:
    """No prefix in common, so the radix cache cannot help: the feature cache does."""
    image = _image(9)
    first = Prompt(processor, llava_dir, "<image>\nWhat is it?", [image])
    second = Prompt(processor, llava_dir, "USER: Tell me about <image> ASSISTANT:", [image])
    calls = _count_encoded(engine)
    try:
        run(engine, first.expanded.input_ids, first.expanded.images)
        out = run(engine, second.expanded.input_ids, second.expanded.images)
    finally:
        del engine.scheduler.runner.model.image_features
    assert calls == [1]
    assert out["meta_info"]["cached_tokens"] <= second.expanded.images[0].offset
    assert out["output_ids"] == _hf_greedy(hf_model, second)


def test_prompt_logprobs_and_penalties_skip_image_positions(engine, processor, llava_dir) -> None:
    prompt = Prompt(processor, llava_dir, "A <image> B", [_image(7)])
    ids, images = prompt.expanded.input_ids, prompt.expanded.images
    out = run(
        engine, ids, images, return_logprob=True, logprob_start_len=0,
        repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
    )  # fmt: skip
    lps = out["meta_info"]["input_token_logprobs"]  # one per prompt position
    span = range(images[0].offset, images[0].offset + images[0].length)
    assert len(lps) == len(ids) and lps[0] is None
    assert all(lps[p] is None for p in span)
    assert all(isinstance(lps[p], float) for p in range(1, len(ids)) if p not in span)
    assert len(out["output_ids"]) == 8


def test_a_malformed_image_ends_only_its_request(engine, processor, llava_dir) -> None:
    prompt = Prompt(processor, llava_dir, "<image> what?", [_image(8)])
    ids, (item,) = prompt.expanded.input_ids, prompt.expanded.images
    bad = {
        "short span": ([*ids], [_replace(item, length=item.length - 1)]),
        "wrong shape": ([*ids], [_replace(item, shape=[3, 16, 64])]),
        "bytes short": ([*ids], [_replace(item, pixel_values=item.pixel_values[:-4])]),
        "in-vocab id in the span": ([*ids[:1], 5, *ids[2:]], [item]),
        "past the prompt": ([*ids], [_replace(item, offset=len(ids) - 2)]),
        "no image for hash ids": ([*ids], []),
    }
    for name, (bad_ids, bad_images) in bad.items():
        out = run(engine, bad_ids, bad_images)
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 400, name
    assert len(run(engine, ids, [item])["output_ids"]) == 8  # and the engine serves on


def test_images_to_a_text_only_model_are_refused(make_engine, tiny_llama_dir) -> None:
    text_only = make_engine(tiny_llama_dir, max_total_tokens=1024)
    item = ImageItem("00" * 32, 1, 2, b"\0" * 12, [3, 1, 1])
    out = run(text_only, [1, 10**6, 10**6 + 1, 2], [item])
    reason = out["meta_info"]["finish_reason"]
    assert reason["status_code"] == 400 and "text only" in reason["message"]
    with pytest.raises(ValueError, match="accepts text only"):
        text_only.generate("hi", image_data="data:image/png;base64,aGVsbG8=")


def _replace(item: ImageItem, **changes: Any) -> ImageItem:
    import msgspec

    return msgspec.structs.replace(item, **changes)


def test_retracted_image_requests_finish_with_the_same_tokens(
    make_engine, engine, processor, llava_dir, monkeypatch
) -> None:
    """A pool too small for all of them: requests are retracted and prefilled again, images
    and all, and end with the tokens of an unhindered run."""
    from tests.scheduler.test_retraction import count_retractions, set_new_token_ratio

    tight = make_engine(llava_dir, max_total_tokens=240, max_running_requests=8)
    set_new_token_ratio(tight.scheduler, 0.05, monkeypatch)
    prompts = [
        Prompt(processor, llava_dir, f"Picture {k}: <image> says", [_image(20 + k)])
        for k in range(6)
    ]
    want = [
        run(engine, p.expanded.input_ids, p.expanded.images, max_new_tokens=48) for p in prompts
    ]
    retractions = count_retractions(tight.scheduler)
    rids = []
    for p in prompts:
        rid = f"img-{next(_rids)}"
        rids.append(rid)
        tight.scheduler.add_request(
            TokenizedGenerateReqInput(
                rid=rid, input_ids=p.expanded.input_ids, images=p.expanded.images,
                sampling_params=parse_sampling_params(
                    {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
                ),
            )
        )  # fmt: skip
    got = tight._run_until_done(rids)
    assert sum(retractions) > 0, "the pool was big enough: nothing was retracted"
    assert [got[r]["output_ids"] for r in rids] == [w["output_ids"] for w in want]


def test_engine_image_data_equals_transformers(engine, processor, hf_model, llava_dir) -> None:
    import base64

    text = "USER: <image> then <image>\nWhich? ASSISTANT:"
    images = [_image(30), _image(31, (50, 30))]
    uris = []
    for image in images:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        uris.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    out = engine.generate(text, greedy, image_data=uris)
    assert out["output_ids"] == _hf_greedy(hf_model, Prompt(processor, llava_dir, text, images))
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        engine.generate(text, greedy, image_data=uris[0])
    with pytest.raises(ValueError, match="not an image"):
        engine.generate("<image>", greedy, image_data="data:image/png;base64,aGVsbG8=")
