"""Idefics3 / SmolVLM against transformers' own classes, in float32, within 1e-4.

Tiny random-weight checkpoints of both architectures (the same modules and names); prompts and
pixels come from the checkpoint's Idefics3Processor with image splitting on, so an image is a
grid of tiles plus the global image, each tile a run of `image_seq_len` image tokens. sluice
runs them through the paged KV path with each tile given as its own `ImageSpan`, whose ids are
replaced by out-of-vocabulary ones (as the hash ids are), so only the features fill those rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.model.models.idefics3 import pixel_shuffle, tile_position_ids
from sluice.model.multimodal import ImageSpan
from tests.model.test_llava import Driver, _max_diff
from tests.tiny_models import make_tiny_idefics3

ATOL = 1e-4
HASH_ID = 10**9


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def idefics3(request, tmp_path_factory, smollm2_hf_dir):
    """(checkpoint dir, transformers model, processor) of one architecture."""
    import transformers
    from transformers import AutoProcessor

    path = make_tiny_idefics3(
        tmp_path_factory.mktemp(f"tiny_{request.param}"),
        tokenizer_dir=smollm2_hf_dir,
        arch=request.param,
    )
    cls = {
        "idefics3": transformers.Idefics3ForConditionalGeneration,
        "smolvlm": transformers.SmolVLMForConditionalGeneration,
    }[request.param]
    hf = cls.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, AutoProcessor.from_pretrained(path)


def _image(seed: int, size: tuple[int, int] = (40, 48)):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _prompt(processor, text: str, images: list):
    inputs = processor(text=text, images=images, return_tensors="pt")
    return inputs["input_ids"][0].tolist(), inputs["pixel_values"], inputs["pixel_attention_mask"]


def _spans(ids: list[int], pixel_values: torch.Tensor, image_token_id: int) -> list[ImageSpan]:
    """One span per tile: the runs of image tokens, in order, one per row of pixel_values."""
    tiles = pixel_values.flatten(0, 1)  # [tiles, C, H, W]
    runs: list[list[int]] = []
    for i, t in enumerate(ids):
        if t == image_token_id:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
    assert len(runs) == len(tiles) and len({len(r) for r in runs}) == 1
    return [ImageSpan(tile, run[0], len(run)) for tile, run in zip(tiles, runs, strict=True)]


def _hashed(ids: list[int], image_token_id: int) -> list[int]:
    return [HASH_ID + i if t == image_token_id else t for i, t in enumerate(ids)]


def _hf_logits(hf, ids: list[int], pixel_values, pixel_attention_mask) -> torch.Tensor:
    with torch.no_grad():
        return hf(
            input_ids=torch.tensor([ids]),
            pixel_values=pixel_values,
            pixel_attention_mask=pixel_attention_mask,
        ).logits[0]


def test_tile_position_ids_are_row_major_for_small_grids():
    assert tile_position_ids(8).tolist() == list(range(64))


def test_pixel_shuffle_folds_neighbouring_patches():
    # a 4x4 grid of 1-wide patches numbered row-major; scale 2: each row of the output holds a
    # 2x2 block, in transformers' order (the block's columns first)
    x = torch.arange(16.0).view(1, 16, 1)
    out = pixel_shuffle(x, 2)
    assert out.shape == (1, 4, 4)
    assert out[0, 0].tolist() == [0.0, 1.0, 4.0, 5.0]
    assert out[0, 3].tolist() == [10.0, 11.0, 14.0, 15.0]


def test_image_features_match_transformers(idefics3):
    path, hf, processor = idefics3
    inputs = processor.image_processor([[_image(0), _image(1, (20, 64))]], return_tensors="pt")
    pixel_values = inputs["pixel_values"]  # [1, 5 + 3 tiles, 3, 32, 32]
    model = Driver(path).runner.model
    with torch.inference_mode():
        got = model.image_features(pixel_values[0])
        want = hf.model.get_image_features(
            pixel_values=pixel_values, pixel_attention_mask=inputs["pixel_attention_mask"]
        ).pooler_output
    want = torch.cat(want).view(got.shape)
    assert got.shape == (8, 16, hf.config.text_config.hidden_size)
    assert _max_diff(got, want) <= ATOL


def test_one_image_prompt_matches(idefics3):
    path, hf, processor = idefics3
    ids, pixels, mask = _prompt(processor, "User:<image>What is this?\nAssistant:", [_image(2)])
    image_id = hf.config.image_token_id
    spans = _spans(ids, pixels, image_id)
    assert len(spans) == 5  # a 2x2 grid and the global image
    drv = Driver(path)
    row = drv.new_seq()
    (got,) = drv.extend({row: _hashed(ids, image_id)}, {row: spans})
    assert _max_diff(got, _hf_logits(hf, ids, pixels, mask)) <= ATOL


def test_two_image_prompt_matches(idefics3):
    path, hf, processor = idefics3
    text = "User:<image> and <image>\nWhich is brighter?\nAssistant:"
    ids, pixels, mask = _prompt(processor, text, [_image(3, (20, 64)), _image(4, (64, 20))])
    image_id = hf.config.image_token_id
    spans = _spans(ids, pixels, image_id)
    assert len(spans) == 6  # 1x2 and 2x1 grids, each with its global image
    drv = Driver(path)
    row = drv.new_seq()
    (got,) = drv.extend({row: _hashed(ids, image_id)}, {row: spans})
    assert _max_diff(got, _hf_logits(hf, ids, pixels, mask)) <= ATOL


def test_chunk_cut_inside_a_tile_matches(idefics3):
    """A prefill cut in the middle of a tile's span, the rest beside a fresh prompt in the same
    forward: each chunk takes its own rows of the tile's features."""
    path, hf, processor = idefics3
    image_id = hf.config.image_token_id
    ids, pixels, mask = _prompt(processor, "User:<image>Describe it.", [_image(5)])
    other_ids, other_pixels, other_mask = _prompt(
        processor, "<image>Compare.", [_image(6, (20, 64))]
    )
    spans, other_spans = _spans(ids, pixels, image_id), _spans(other_ids, other_pixels, image_id)
    cut = spans[1].offset + spans[1].length // 2 + 1
    drv = Driver(path)
    a, b = drv.new_seq(), drv.new_seq()
    hashed = _hashed(ids, image_id)
    (first,) = drv.extend({a: hashed[:cut]}, {a: spans})
    rest, other = drv.extend(
        {a: hashed[cut:], b: _hashed(other_ids, image_id)}, {a: spans, b: other_spans}
    )
    want = _hf_logits(hf, ids, pixels, mask)
    assert _max_diff(first, want[:cut]) <= ATOL
    assert _max_diff(rest, want[cut:]) <= ATOL
    assert _max_diff(other, _hf_logits(hf, other_ids, other_pixels, other_mask)) <= ATOL


def test_a_prefix_cache_hit_on_the_same_image_matches(idefics3):
    """A second request with the same image and another question reuses the first's KV for
    everything up to the question (as a radix match gives it) and computes only the rest; its
    tiles are all cached, so none is encoded again."""
    path, hf, processor = idefics3
    image_id = hf.config.image_token_id
    image = _image(7, (64, 40))
    ids, pixels, _ = _prompt(processor, "User:<image>What colour?", [image])
    ids2, pixels2, mask2 = _prompt(processor, "User:<image>How big is it?", [image])
    spans2 = _spans(ids2, pixels2, image_id)
    shared = next(i for i, (x, y) in enumerate(zip(ids, ids2, strict=False)) if x != y)
    assert shared > spans2[-1].offset + spans2[-1].length  # every tile lies in the prefix
    drv = Driver(path)
    a = drv.new_seq()
    drv.extend({a: _hashed(ids, image_id)}, {a: _spans(ids, pixels, image_id)})
    b = drv.new_seq()
    drv.pool.req_to_token[b, :shared] = drv.pool.req_to_token[a, :shared]
    drv.lens[b] = shared
    (got,) = drv.extend({b: _hashed(ids2, image_id)[shared:]}, {b: spans2})
    assert _max_diff(got, _hf_logits(hf, ids2, pixels2, mask2)[shared:]) <= ATOL


def test_text_only_prompt_matches(idefics3):
    path, hf, processor = idefics3
    ids = processor.tokenizer("User: Hello there.\nAssistant:")["input_ids"]
    drv = Driver(path)
    row = drv.new_seq()
    (got,) = drv.extend({row: ids}, {})
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    assert _max_diff(got, want) <= ATOL
