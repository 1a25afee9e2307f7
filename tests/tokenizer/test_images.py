"""Images for the model (HTTP side): the processor in the media workers, placeholder expansion
into hash ids, and the wire item that carries an image to the scheduler."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
import pytest

from sluice.checkpoint.model_config import ModelConfig
from sluice.checkpoint.vision import ImageSlots
from sluice.config import ServerArgs
from sluice.launch import ServingProcesses
from sluice.messages import ImageItem, SamplingParams, TokenizedGenerateReqInput, ToScheduler
from sluice.tokenizer.generate_input import GenerateReqInput
from sluice.tokenizer.images import MAX_IMAGE_ID, expand_images, image_ids
from sluice.tokenizer.media import MediaManager, MediaPolicy
from sluice.tokenizer.media.process import ProcessedImage
from sluice.tokenizer.normalize import RequestError
from sluice.utils import ipc
from tests.tiny_models import make_tiny_llava

VOCAB = 1000
SLOTS = ImageSlots(image_token_id=999, tokens_per_tile=4, tile_shape=(3, 2, 2))
HASH_A, HASH_B = "ab" * 32, "cd" * 32


def _processed(image_hash: str) -> ProcessedImage:
    return ProcessedImage(image_hash, np.arange(12, dtype=np.float32).reshape(3, 2, 2))


def _png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


# ---- hash ids and expansion --------------------------------------------------------------------


def test_image_ids_come_from_the_hash_alone_outside_the_vocabulary() -> None:
    a, b = image_ids(HASH_A, 20, VOCAB), image_ids(HASH_B, 20, VOCAB)
    assert a == image_ids(HASH_A, 20, VOCAB)  # the same image: the same ids, for the cache
    assert a != b and not set(a) & set(b)
    assert all(VOCAB <= t < MAX_IMAGE_ID for t in a + b)
    assert len(set(a)) == 1 or a[:8] != a[8:16] or len(set(a[:8])) > 1  # not one constant id


def test_one_placeholder_per_image_expands_with_explicit_offsets() -> None:
    ids = [1, 999, 2, 3, 999, 999, 4]  # text, image A, text, images A and B side by side
    images = [_processed(HASH_A), _processed(HASH_A), _processed(HASH_B)]
    out = expand_images(ids, images, SLOTS, VOCAB, "messages")
    a, b = image_ids(HASH_A, 4, VOCAB), image_ids(HASH_B, 4, VOCAB)
    assert out.input_ids == [1, *a, 2, 3, *a, *b, 4]
    assert out.display_ids == [1, *[999] * 4, 2, 3, *[999] * 8, 4]
    assert [(i.hash, i.offset, i.length) for i in out.images] == [
        (HASH_A, 1, 4), (HASH_A, 7, 4), (HASH_B, 11, 4),
    ]  # fmt: skip
    for item in out.images:
        assert out.input_ids[item.offset : item.offset + item.length] == image_ids(
            item.hash, 4, VOCAB
        )
        pixels = np.frombuffer(item.pixel_values, dtype=item.dtype).reshape(item.shape)
        assert np.array_equal(pixels, _processed(HASH_A).pixel_values)
    # id >= vocab exactly at the image positions
    spans = {p for i in out.images for p in range(i.offset, i.offset + i.length)}
    assert {p for p, t in enumerate(out.input_ids) if t >= VOCAB} == spans


def test_a_prompt_expanded_by_the_processor_is_taken_as_it_is() -> None:
    ids = [5, *[999] * 4, *[999] * 4, 6]
    out = expand_images(ids, [_processed(HASH_A), _processed(HASH_B)], SLOTS, VOCAB, "input_ids")
    assert out.display_ids == ids
    assert [(i.offset, i.length) for i in out.images] == [(1, 4), (5, 4)]
    assert out.input_ids[1:9] == image_ids(HASH_A, 4, VOCAB) + image_ids(HASH_B, 4, VOCAB)


@pytest.mark.parametrize(("ids", "num_images"), [([1, 2], 1), ([999, 999], 1), ([1, 999], 0)])
def test_placeholders_and_images_must_match(ids: list[int], num_images: int) -> None:
    with pytest.raises(RequestError) as info:
        expand_images(ids, [_processed(HASH_A)] * num_images, SLOTS, VOCAB, "messages")
    assert info.value.status_code == 400 and "image placeholders" in info.value.message


def test_image_item_round_trips_inside_a_request() -> None:
    out = expand_images([1, 999, 2], [_processed(HASH_A)], SLOTS, VOCAB, "messages")
    msg = TokenizedGenerateReqInput(
        rid="r", input_ids=out.input_ids, sampling_params=SamplingParams(max_new_tokens=3),
        images=out.images,
    )  # fmt: skip
    back = ipc.Inbox(ToScheduler).decode(ipc.encode(msg))
    assert back == msg and isinstance(back.images[0], ImageItem)
    plain = ipc.Inbox(ToScheduler).decode(
        ipc.encode(TokenizedGenerateReqInput("t", [1], SamplingParams()))
    )
    assert plain.images == []
    assert b"images" not in msgspec.msgpack.encode(plain)  # text-only requests carry nothing


# ---- the processor in the media workers --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory, smollm2_hf_dir: str) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("tiny_llava"), tokenizer_dir=smollm2_hf_dir)


def test_slots_agree_with_the_model_and_its_processor(tiny_llava: str) -> None:
    from transformers import AutoProcessor

    from sluice.model.models.llava import LlavaVisionConfig

    cfg = ModelConfig.from_hf_dir(tiny_llava)
    slots = ImageSlots.of(cfg)
    assert slots is not None
    assert slots.tokens_per_tile == LlavaVisionConfig.from_dict(cfg.multimodal).tokens_per_image
    processor = AutoProcessor.from_pretrained(tiny_llava)
    ids = processor(text="<image>", images=[_image(_png(0))])["input_ids"][0]
    assert list(ids).count(slots.image_token_id) == slots.tokens_per_tile == 16
    assert ImageSlots.of(dataclasses.replace(cfg, multimodal=None)) is None


def _image(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def test_processed_pixels_equal_transformers_and_are_cached(tiny_llava: str) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_llava)
    pngs = [_png(1), _png(2, (64, 40))]

    async def go() -> tuple[list[ProcessedImage], list[ProcessedImage], MediaManager]:
        manager = MediaManager(
            MediaPolicy(), executor=ThreadPoolExecutor(1), processor_dir=tiny_llava
        )
        try:
            first = await manager.process_images([_data_uri(p) for p in pngs])
            again = await manager.process_images([_data_uri(pngs[1])])
        finally:
            await manager.close()
        return first, again, manager

    first, again, manager = asyncio.run(go())
    want = processor.image_processor([_image(p) for p in pngs], return_tensors="np")
    for got, expected in zip(first, want["pixel_values"], strict=True):
        assert got.pixel_values.dtype == np.float32 and got.pixel_values.shape == (3, 32, 32)
        assert np.array_equal(got.pixel_values, expected)
    assert again[0] is first[1]  # the processed image came from the cache
    assert len(manager.processed_cache) == 2 and len(manager.cache) == 0


def test_an_image_three_pixels_high_is_read_channels_last(tiny_llava: str) -> None:
    """A [3, W, 3] array could be channels-first: the processor is told it is not."""
    from transformers import AutoProcessor

    from sluice.tokenizer.media.process import process_image

    png = _png(12, (3, 50))
    got = process_image(png, "h", 10**6, tiny_llava).pixel_values
    image = np.asarray(_image(png))
    want = AutoProcessor.from_pretrained(tiny_llava).image_processor(
        [image], return_tensors="np", input_data_format="channels_last"
    )["pixel_values"][0]
    assert got.shape == (3, 32, 32) and np.array_equal(got, want)


class HeldExecutor(ThreadPoolExecutor):
    """Runs each work item only once `release` is set; `started` tells that one is held."""

    def __init__(self) -> None:
        super().__init__(1, thread_name_prefix="held-media")
        self.started, self.release = threading.Event(), threading.Event()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        def held() -> Any:
            self.started.set()
            self.release.wait(60)
            return fn(*args, **kwargs)

        return super().submit(held)


def test_abort_while_the_image_is_processed_ends_at_once(tiny_llava: str) -> None:
    """A request whose image sits in the processor (held there by construction) ends with an
    abort as soon as it is aborted, leaves nothing in any process, and the image serves the
    next request once the processor is free."""
    args = ServerArgs(
        model_path=tiny_llava, max_total_tokens=2048, check_invariants=True,
        no_embedding_model=True,
    )  # fmt: skip
    image = _data_uri(_png(11))
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}

    async def go() -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        procs = ServingProcesses(args)
        tm = await procs.__aenter__()
        try:
            assert tm.images is not None
            executor = HeldExecutor()
            tm.images.media._executor = executor  # the processor pool, replaced
            req = GenerateReqInput(text="<image> hi", image_data=image, rid="held",
                                   sampling_params=params)  # fmt: skip
            gen = tm.generate_request(req)
            first = asyncio.ensure_future(gen.__anext__())
            assert await asyncio.to_thread(executor.started.wait, 30)
            assert await tm.abort_request("held") == 1
            aborted = await asyncio.wait_for(first, 5)  # not waiting for the processor
            await gen.aclose()
            assert not tm.rid_to_state and not executor.release.is_set()
            executor.release.set()
            again = GenerateReqInput(text="<image> hi", image_data=image, sampling_params=params)
            served = [o async for o in tm.generate_request(again)]
            return aborted, served, await tm.get_internal_state()
        finally:
            await procs.__aexit__(None, None, None)

    aborted, served, state = asyncio.run(asyncio.wait_for(go(), 120))
    assert aborted["meta_info"]["finish_reason"]["code"] == "request_aborted"
    assert len(served) == 1 and len(served[0]["output_ids"]) == 4
    assert state["num_running_reqs"] == state["num_waiting_reqs"] == 0, state
    assert state["num_req_states"] == state["num_detokenizer_states"] == 0, state
    assert state["kv_free"] + state["kv_cached"] == state["kv_total"], state


# ---- chat parts and image_data ------------------------------------------------------------------


def test_chat_image_parts_render_as_the_image_token_in_place() -> None:
    from sluice.server.protocol import ChatMessage
    from sluice.tokenizer import chat

    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": "data:a", "detail": "low"}},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": "http://b"},
    ]
    messages = [
        ChatMessage(role="system", content="Be brief.").template_dict(),
        ChatMessage(role="user", content=parts).template_dict(),
    ]
    assert chat.image_urls(messages) == ["data:a", "http://b"]
    rendered = chat.normalize_messages(messages, "<image>")
    assert rendered[1]["content"] == "Compare\n<image>\nwith\n<image>"
    with pytest.raises(RequestError) as info:
        chat.normalize_messages(messages, None)
    assert "accepts text only" in info.value.message and info.value.status_code == 400
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    for image_token, takes in (("<image>", "text and image_url parts"), (None, "text parts only")):
        with pytest.raises(RequestError, match=f"'input_audio' is not supported: .* {takes}"):
            chat.normalize_messages(audio, image_token)
    with pytest.raises(ValueError, match="image_url"):
        ChatMessage(role="user", content=[{"type": "image_url", "image_url": {}}]).template_dict()


def test_image_data_is_spread_per_prompt() -> None:
    from sluice.tokenizer.images import image_data_per_prompt

    assert image_data_per_prompt(None, 2, False) == [[], []]
    assert image_data_per_prompt("a", 1, True) == [["a"]]
    assert image_data_per_prompt(["a", "b"], 1, True) == [["a", "b"]]
    assert image_data_per_prompt(["a", None, ["b", "c"]], 3, False) == [["a"], [], ["b", "c"]]
    for bad, num, single in [(["a"], 2, False), ([1], 1, True), ([["a"]], 1, True)]:
        with pytest.raises(RequestError):
            image_data_per_prompt(bad, num, single)
