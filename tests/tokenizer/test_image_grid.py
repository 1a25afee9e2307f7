"""Images split into tiles (Idefics3 / SmolVLM), HTTP side: the processor in the media workers
gives every tile and the grid, and the expansion gives exactly the token ids transformers'
Idefics3Processor gives for the same prompt and images, each tile its own wire item."""

from __future__ import annotations

import asyncio
import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sluice.checkpoint.model_config import ModelConfig
from sluice.checkpoint.vision import ImageSlots
from sluice.tokenizer.image_grid import TILE, GridMarkers
from sluice.tokenizer.images import expand_images, image_ids
from sluice.tokenizer.media import MediaError, MediaManager, MediaPolicy
from sluice.tokenizer.media.process import ProcessedImage
from sluice.tokenizer.normalize import RequestError
from tests.tiny_models import make_tiny_idefics3

SIZES = {"wide": (20, 64), "tall": (64, 20), "square": (40, 48)}  # 1x2, 2x1, 2x2 tiles


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def tiny_idefics3(request, tmp_path_factory, smollm2_hf_dir: str) -> str:
    """Each architecture's checkpoint, with its own image processor class."""
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    return make_tiny_idefics3(out, smollm2_hf_dir, arch=request.param)


@pytest.fixture(scope="module")
def hf(tiny_idefics3: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_idefics3)


def _png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def _process(
    model_dir: str, pngs: list[bytes], policy: MediaPolicy | None = None
) -> list[ProcessedImage]:
    async def go() -> list[ProcessedImage]:
        manager = MediaManager(
            policy or MediaPolicy(), executor=ThreadPoolExecutor(1), processor_dir=model_dir
        )
        try:
            uris = ["data:image/png;base64," + base64.b64encode(p).decode() for p in pngs]
            return await manager.process_images(uris)
        finally:
            await manager.close()

    return asyncio.run(go())


def test_slots_of_the_checkpoint(tiny_idefics3: str, hf) -> None:
    slots = ImageSlots.of(ModelConfig.from_hf_dir(tiny_idefics3))
    assert slots == ImageSlots(
        image_token_id=hf.image_token_id, tokens_per_tile=hf.image_seq_len,
        tile_shape=(3, 32, 32), tiling="grid",
    )  # fmt: skip


def test_the_processor_gives_every_tile_and_the_grid(tiny_idefics3: str, hf) -> None:
    pngs = [_png(k, size) for k, size in enumerate(SIZES.values())]
    got = _process(tiny_idefics3, pngs)
    assert [g.grid for g in got] == [(1, 2), (2, 1), (2, 2)]
    for image, png in zip(got, pngs, strict=True):
        want = hf.image_processor([[_pil(png)]], return_tensors="np")["pixel_values"][0]
        assert image.tiles.shape == (image.grid[0] * image.grid[1] + 1, 3, 32, 32)
        assert np.array_equal(image.tiles, want)


def test_the_tiles_of_a_request_are_bounded(tiny_idefics3: str) -> None:
    pngs = [_png(k, size) for k, size in enumerate(SIZES.values())]  # 3 + 3 + 5 tiles
    assert len(_process(tiny_idefics3, pngs, MediaPolicy(max_tiles=11))) == 3
    with pytest.raises(MediaError) as info:
        _process(tiny_idefics3, pngs, MediaPolicy(max_tiles=10))
    pixels = 11 * 3 * 32 * 32 * 4
    assert info.value.message == (
        f"the request's 3 images make 11 tiles ({pixels} bytes of pixels), over the limit of "
        "10 tiles per request (--max-image-tiles-per-request)"
    )
    assert info.value.status_code == 400 and info.value.code == "too_many_image_tiles"


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("User:<image>What is this?<end_of_utterance>\nAssistant:", ["wide"]),
        ("<image><image> Compare them.\n<image>", ["tall", "square", "wide"]),
    ],
    ids=["one-image", "three-images"],
)
def test_expanded_ids_equal_the_processors(tiny_idefics3: str, hf, text, names) -> None:
    pngs = [_png(k, SIZES[n]) for k, n in enumerate(names)]
    images = _process(tiny_idefics3, pngs)
    want = hf(text=text, images=[_pil(p) for p in pngs])["input_ids"][0]
    cfg = ModelConfig.from_hf_dir(tiny_idefics3)
    slots = ImageSlots.of(cfg)
    markers = GridMarkers.from_tokenizer(hf.tokenizer)
    ids = hf.tokenizer(text)["input_ids"]
    out = expand_images(ids, images, slots, cfg.vocab_size, "prompt", markers)
    assert out.display_ids == list(want)
    # one wire item per tile, in order, each its own hash and pixels
    tiles = [(image, k) for image in images for k in range(len(image.tiles))]
    assert len(out.images) == len(tiles) and len({i.hash for i in out.images}) == len(tiles)
    for item, (image, k) in zip(out.images, tiles, strict=True):
        assert item.length == slots.tokens_per_tile and item.shape == [3, 32, 32]
        pixels = np.frombuffer(item.pixel_values, dtype="<f4").reshape(item.shape)
        assert np.array_equal(pixels, image.tiles[k])
        span = out.input_ids[item.offset : item.offset + item.length]
        assert span == image_ids(item.hash, item.length, cfg.vocab_size)
    at_images = {p for i in out.images for p in range(i.offset, i.offset + i.length)}
    assert {p for p, t in enumerate(out.input_ids) if t >= cfg.vocab_size} == at_images
    # the processor's own expansion, given as ids, is taken in place: the same request
    again = expand_images(list(want), images, slots, cfg.vocab_size, "input_ids", markers)
    assert again.input_ids == out.input_ids and again.images == out.images


def test_an_image_not_split_equals_the_processor(tiny_idefics3: str, hf) -> None:
    png = _png(9, SIZES["square"])
    want = hf(text="A<image>B", images=[_pil(png)], do_image_splitting=False)
    pixels = want["pixel_values"][0]  # [1, 3, 32, 32]: the global image only
    image = ProcessedImage("ef" * 32, np.asarray(pixels, dtype=np.float32), (0, 0))
    cfg = ModelConfig.from_hf_dir(tiny_idefics3)
    markers = GridMarkers.from_tokenizer(hf.tokenizer)
    ids = hf.tokenizer("A<image>B")["input_ids"]
    out = expand_images(ids, [image], ImageSlots.of(cfg), cfg.vocab_size, "prompt", markers)
    assert out.display_ids == list(want["input_ids"][0])
    assert [i.hash for i in out.images] == [image.hash]  # one tile: the image's own hash


def test_grid_templates_and_their_limits(hf) -> None:
    markers = GridMarkers.from_tokenizer(hf.tokenizer)
    assert markers.template(2, 3).count(TILE) == 7
    assert markers.template(0, 0) == [markers.fake, markers.global_img, TILE, markers.fake]
    with pytest.raises(ValueError, match="7x1"):
        markers.template(7, 1)
    with pytest.raises(ValueError, match="no token"):
        GridMarkers.from_tokenizer(_NoMarkers())


def test_a_grid_that_disagrees_with_the_tiles_is_a_400(tiny_idefics3: str, hf) -> None:
    cfg = ModelConfig.from_hf_dir(tiny_idefics3)
    tiles = np.zeros((3, 3, 32, 32), dtype=np.float32)
    image = ProcessedImage("ab" * 32, tiles, (2, 2))  # 2x2 needs 5 tiles
    ids = hf.tokenizer("<image>")["input_ids"]
    with pytest.raises(RequestError) as info:
        expand_images(
            ids, [image], ImageSlots.of(cfg), cfg.vocab_size, "prompt",
            GridMarkers.from_tokenizer(hf.tokenizer),
        )  # fmt: skip
    assert info.value.status_code == 400 and "3 tiles" in info.value.message


class _NoMarkers:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]
