"""Images split into tiles through the real server (tiny Idefics3, float32): a chat with an
image and /generate with two images give transformers' greedy tokens for the same inputs (the
Idefics3Processor's prompt and tiles); a repeated image hits the prefix cache on all its tiles;
a mismatch of placeholders and images, or more tiles than a request may have, is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from tests.server.live_server import LiveServer, assert_no_state_left, running_server
from tests.server.test_e2e_images import (
    NUM_TOKENS,
    SERVER_ARGS,
    _chat,
    _data_uri,
    _image,
    _image_part,
    _template,
)
from tests.tiny_models import make_tiny_idefics3

TOKENS_PER_TILE = 16


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> str:
    return make_tiny_idefics3(tmp_path_factory.mktemp("e2e_idefics3"), smollm2_hf_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, idefics3_dir: str) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("e2e_idefics3_server") / "server.log"
    args = [*SERVER_ARGS, "--max-image-tiles-per-request", "64"]
    with running_server(idefics3_dir, args, log) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(idefics3_dir: str) -> Any:
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(idefics3_dir, dtype=torch.float32)
    return model.eval(), AutoProcessor.from_pretrained(idefics3_dir)


def _hf_greedy(reference: Any, text: str, images: list[Any]) -> tuple[list[int], int]:
    model, processor = reference
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new) == NUM_TOKENS
    return new, inputs["input_ids"].shape[1]


def test_chat_with_an_image_equals_transformers(server, reference) -> None:
    image = _image(1, (20, 64))  # 1x2 tiles and the global image
    content = [_image_part(image), {"type": "text", "text": "What is in the picture?"}]
    messages = [{"role": "user", "content": content}]
    resp = _chat(server, messages)
    assert resp.status_code == 200, resp.text
    want, prompt_len = _hf_greedy(reference, _template(reference, messages), [image])
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == prompt_len
    tokenizer = reference[1].tokenizer
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(
        want, skip_special_tokens=True
    )


def test_generate_with_two_images_equals_transformers(server, reference) -> None:
    text = "User:<image>\nand this one: <image>\nAssistant:"
    images = [_image(5, (64, 20)), _image(6, (40, 48))]  # 2x1 and 2x2 tiles
    body = {"text": text, "image_data": [_data_uri(i) for i in images],
            "sampling_params": {"temperature": 0, "max_new_tokens": NUM_TOKENS,
                                "ignore_eos": True}}  # fmt: skip
    resp = httpx.post(f"{server.base}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    want, prompt_len = _hf_greedy(reference, text, images)
    assert resp.json()["output_ids"] == want
    assert resp.json()["meta_info"]["prompt_tokens"] == prompt_len


def test_a_repeated_image_hits_the_prefix_cache_on_every_tile(server) -> None:
    image = _image(7, (40, 48))  # 5 tiles
    messages = [{"role": "user", "content": [_image_part(image), {"type": "text", "text": "?"}]}]
    first, second = _chat(server, messages), _chat(server, messages)
    assert first.status_code == second.status_code == 200, first.text
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 5 * TOKENS_PER_TILE
    assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    other = [{"role": "user", "content": [_image_part(_image(8)), {"type": "text", "text": "?"}]}]
    fresh = _chat(server, other).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    # another image: only the text before its first tile comes cached, none of its tiles
    assert cached - fresh >= 5 * TOKENS_PER_TILE


def test_placeholders_must_match_the_images(server) -> None:
    body = {"text": "<image> <image>", "image_data": _data_uri(_image(1)),
            "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
    resp = httpx.post(f"{server.base}/generate", json=body, timeout=60)
    assert resp.status_code == 400 and "2 image placeholders for 1 images" in resp.text
    assert _chat(server, [{"role": "user", "content": "hello"}]).status_code == 200


def test_too_many_tiles_in_one_request_is_a_400(server) -> None:
    """13 images of 2x2 tiles and the global image: 65 tiles, over the server's 64 (refused
    before the prompt's length is checked: 1040 positions, past the tiny model's 512)."""
    image = _data_uri(_image(3))
    body = {"text": "<image>" * 13, "image_data": [image] * 13,
            "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
    resp = httpx.post(f"{server.base}/generate", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "too_many_image_tiles"
    message = error["message"]
    assert "the request's 13 images make 65 tiles" in message
    assert "over the limit of 64 tiles per request (--max-image-tiles-per-request)" in message
    body.update(text="<image>", image_data=[image])  # served: the refusal left nothing stuck
    again = httpx.post(f"{server.base}/generate", json=body, timeout=60)
    assert again.status_code == 200, again.text


def test_no_state_left_behind(server) -> None:
    assert_no_state_left(server.wait_idle())
