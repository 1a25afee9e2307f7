"""Images split into tiles through the scheduler (tiny Idefics3, float32, the in-process
Engine with `image_data`): greedy tokens equal transformers', with and without prefill chunks
that cut through tiles; a repeated image comes from the prefix cache without encoding any tile
again; a tile of the wrong shape ends only its own request with a 400."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch

from sluice.engine import Engine
from tests.scheduler.test_images import _count_encoded, _replace, run
from tests.tiny_models import make_tiny_idefics3

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> str:
    return make_tiny_idefics3(tmp_path_factory.mktemp("tiny_idefics3"), smollm2_hf_dir)


@pytest.fixture(scope="module")
def reference(idefics3_dir: str) -> Any:
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(idefics3_dir, dtype=torch.float32)
    return model.eval(), AutoProcessor.from_pretrained(idefics3_dir)


@pytest.fixture(scope="module")
def engine(make_engine: Any, idefics3_dir: str) -> Engine:
    return make_engine(idefics3_dir, max_total_tokens=2048)


def _image(seed: int, size: tuple[int, int]) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _uri(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _hf_greedy(reference: Any, text: str, images: list[Any]) -> list[int]:
    model, processor = reference
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


TEXT = "User:<image> then <image>\nWhich?\nAssistant:"
IMAGES = [(1, (20, 64)), (2, (40, 48))]  # 1x2 and 2x2 tiles, each with its global image


def test_greedy_tokens_equal_transformers(engine, reference) -> None:
    images = [_image(seed, size) for seed, size in IMAGES]
    out = engine.generate(TEXT, GREEDY, image_data=[_uri(i) for i in images])
    assert out["output_ids"] == _hf_greedy(reference, TEXT, images)


def test_chunks_cut_through_tiles_give_the_same_tokens(make_engine, reference, idefics3_dir):
    chunked = make_engine(idefics3_dir, max_total_tokens=2048, chunked_prefill_size=7)
    images = [_image(seed, size) for seed, size in IMAGES]
    calls = _count_encoded(chunked)
    try:
        out = chunked.generate(TEXT, GREEDY, image_data=[_uri(i) for i in images])
    finally:
        del chunked.scheduler.runner.model.image_features
    assert out["output_ids"] == _hf_greedy(reference, TEXT, images)
    # 8 tiles of 16 positions, each cut by the 7-token chunks: encoded once, at its first chunk
    # (the feature cache serves the later ones)
    assert sum(calls) == 8


def test_a_repeated_image_hits_the_prefix_cache_without_encoding(engine) -> None:
    uri = _uri(_image(3, (64, 20)))
    calls = _count_encoded(engine)
    try:
        first = engine.generate("<image>\nDescribe it:", GREEDY, image_data=uri)
        second = engine.generate("<image>\nDescribe it:", GREEDY, image_data=uri)
    finally:
        del engine.scheduler.runner.model.image_features
    assert calls == [3]  # the first request's 3 tiles in one forward; none for the second
    assert second["output_ids"] == first["output_ids"]
    assert second["meta_info"]["cached_tokens"] >= 3 * 16


def test_a_tile_of_the_wrong_shape_ends_only_its_request(engine) -> None:
    images = engine._with_images(
        [engine.tokenizer.encode("<image> what?")], _uri(_image(4, (20, 64))), True
    )[0]
    ids, items = images.input_ids, images.images
    assert len(items) == 3
    bad = [*items[:1], _replace(items[1], shape=[3, 16, 64]), *items[2:]]
    out = run(engine, ids, bad)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "shape" in reason["message"]
    assert len(run(engine, ids, items)["output_ids"]) == 8  # and the engine serves on
