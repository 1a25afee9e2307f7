"""LLaVA against transformers' LlavaForConditionalGeneration, in float32, within 1e-4.

Tiny random-weight checkpoints in two variants: the "default" one (features of layer -2 without
the class token, quick_gelu tower) and a "full" one (the class token kept, layers -1 and 0
concatenated, gelu tower, tanh-gelu projector). Prompts and pixels come from the checkpoint's
own LlavaProcessor; sluice runs them through the paged KV path with each image given as an
`ImageSpan` of its placeholder positions, whose ids are replaced by out-of-vocabulary ones (as
the image-hash ids will be) to show that only the features fill those rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.checkpoint.model_config import ModelConfig
from sluice.model.forward_batch import ForwardBatch, ForwardMode
from sluice.model.multimodal import ImageFeatureCache, ImageSpan, MultimodalInputs
from sluice.model.runner import ModelRunner
from sluice.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from tests.tiny_models import make_tiny_llava

ATOL = 1e-4
HASH_ID = 10**9  # placeholder ids as the radix cache will see them: outside the vocabulary

VARIANTS = {
    "default": {},
    "full": {
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": [-1, 0],
        "projector_hidden_act": "gelu_pytorch_tanh",
        "vision_overrides": {"hidden_act": "gelu"},
    },
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(VARIANTS))
def llava(request, tmp_path_factory, smollm2_hf_dir):
    """(checkpoint dir, transformers model, processor) of one variant."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = make_tiny_llava(
        tmp_path_factory.mktemp(f"tiny_llava_{request.param}"),
        tokenizer_dir=smollm2_hf_dir,
        **VARIANTS[request.param],
    )
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, AutoProcessor.from_pretrained(path)


def _image(seed: int, size: tuple[int, int] = (40, 48)):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


class Driver:
    """Drives a ModelRunner by hand: one request row per sequence, slots from an allocator."""

    def __init__(self, hf_dir: str) -> None:
        self.runner = ModelRunner(
            ModelConfig.from_hf_dir(hf_dir), torch.device("cpu"), torch.float32, kv_size=1024
        )
        self.alloc = TokenToKVPoolAllocator(1024)
        self.pool = ReqToTokenPool(4, 256)
        self.lens: dict[int, int] = {}

    def new_seq(self) -> int:
        row = self.pool.alloc()
        self.lens[row] = 0
        return row

    def extend(
        self, chunks: dict[int, list[int]], images: dict[int, list[ImageSpan]]
    ) -> list[torch.Tensor]:
        """Append `chunks[row]` to each sequence in one EXTEND forward; all logits per chunk.
        `images[row]`: all of the sequence's images (the forward takes those it overlaps)."""
        rows = list(chunks)
        slots = self.alloc.alloc(sum(len(c) for c in chunks.values()))
        offset = 0
        for row in rows:
            n, start = len(chunks[row]), self.lens[row]
            self.pool.req_to_token[row, start : start + n] = slots[offset : offset + n]
            offset += n
        ids = [t for row in rows for t in chunks[row]]
        fb = ForwardBatch.build(
            ForwardMode.EXTEND, ids, [self.lens[r] for r in rows], [len(chunks[r]) for r in rows],
            slots, self.pool.req_to_token, rows, list(range(len(ids))), torch.device("cpu"),
            images=[images.get(r, []) for r in rows],
        )  # fmt: skip
        logits = self.runner.forward(fb)
        for row in rows:
            self.lens[row] += len(chunks[row])
        return list(logits.split([len(chunks[r]) for r in rows]))


def _prompt(processor, text: str, images: list) -> tuple[list[int], torch.Tensor]:
    inputs = processor(text=text, images=images, return_tensors="pt")
    return inputs["input_ids"][0].tolist(), inputs["pixel_values"]


def _spans(ids: list[int], pixel_values: torch.Tensor, image_token_id: int) -> list[ImageSpan]:
    """One span per image, in order. Every image here takes the same number of positions, so
    the placeholders split evenly (adjacent images make one run of ids: the HTTP side will give
    each image's offset, not leave it to be guessed from the ids)."""
    positions = [i for i, t in enumerate(ids) if t == image_token_id]
    per_image = len(positions) // len(pixel_values)
    spans = [
        ImageSpan(pixel_values[k], positions[k * per_image], per_image)
        for k in range(len(pixel_values))
    ]
    assert all(
        positions[k * per_image + per_image - 1] == s.offset + per_image - 1
        for k, s in enumerate(spans)
    )
    return spans


def _hashed(ids: list[int], image_token_id: int) -> list[int]:
    return [HASH_ID + i if t == image_token_id else t for i, t in enumerate(ids)]


def _hf_logits(hf, ids: list[int], pixel_values: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), pixel_values=pixel_values).logits[0]


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got - want).abs().max().item()
    print(f"max abs diff {diff:.2e} over {tuple(got.shape)}")
    return diff


def test_image_features_match_transformers(llava):
    path, hf, processor = llava
    pixel_values = processor.image_processor([_image(0), _image(1, (64, 40))], return_tensors="pt")
    pixel_values = pixel_values["pixel_values"]  # [2, 3, 32, 32]
    model = Driver(path).runner.model
    with torch.inference_mode():
        got = model.image_features(pixel_values)
        want = torch.stack(hf.model.get_image_features(pixel_values=pixel_values).pooler_output)
    assert (
        got.shape
        == want.shape
        == (2, model.mm_cfg.tokens_per_image, hf.config.text_config.hidden_size)
    )
    assert _max_diff(got, want) <= ATOL


def test_one_image_prompt_matches(llava):
    path, hf, processor = llava
    ids, pixel_values = _prompt(processor, "USER: <image>\nWhat is this? ASSISTANT:", [_image(2)])
    image_id = hf.config.image_token_id
    drv = Driver(path)
    row = drv.new_seq()
    (got,) = drv.extend({row: _hashed(ids, image_id)}, {row: _spans(ids, pixel_values, image_id)})
    assert _max_diff(got, _hf_logits(hf, ids, pixel_values)) <= ATOL


def test_two_image_prompt_matches(llava):
    path, hf, processor = llava
    text = "USER: <image> and <image>\nWhich is brighter? ASSISTANT:"
    ids, pixel_values = _prompt(processor, text, [_image(3), _image(4, (48, 64))])
    image_id = hf.config.image_token_id
    spans = _spans(ids, pixel_values, image_id)
    assert len(spans) == 2
    drv = Driver(path)
    row = drv.new_seq()
    (got,) = drv.extend({row: _hashed(ids, image_id)}, {row: spans})
    assert _max_diff(got, _hf_logits(hf, ids, pixel_values)) <= ATOL


def test_chunk_cut_inside_an_image_matches(llava):
    """A prefill cut in the middle of the image span, the rest from the KV cache beside a fresh
    two-image prompt in the same forward: each chunk takes its own rows of the features."""
    path, hf, processor = llava
    image_id = hf.config.image_token_id
    ids, pixels = _prompt(processor, "USER: <image>\nDescribe it. ASSISTANT:", [_image(5)])
    other_ids, other_pixels = _prompt(processor, "<image><image> Compare.", [_image(6), _image(7)])
    spans, other_spans = _spans(ids, pixels, image_id), _spans(other_ids, other_pixels, image_id)
    cut = spans[0].offset + spans[0].length // 2 + 1
    drv = Driver(path)
    a, b = drv.new_seq(), drv.new_seq()
    hashed = _hashed(ids, image_id)
    (first,) = drv.extend({a: hashed[:cut]}, {a: spans})
    rest, other = drv.extend(
        {a: hashed[cut:], b: _hashed(other_ids, image_id)}, {a: spans, b: other_spans}
    )
    want = _hf_logits(hf, ids, pixels)
    assert _max_diff(first, want[:cut]) <= ATOL
    assert _max_diff(rest, want[cut:]) <= ATOL
    assert _max_diff(other, _hf_logits(hf, other_ids, other_pixels)) <= ATOL


def test_text_only_prompt_matches(llava):
    path, hf, processor = llava
    ids = processor.tokenizer("USER: Hello there. ASSISTANT:")["input_ids"]
    drv = Driver(path)
    row = drv.new_seq()
    (got,) = drv.extend({row: ids}, {})
    assert _max_diff(got, _hf_logits(hf, ids, None)) <= ATOL


def test_multimodal_inputs_slice_spans_by_position():
    """Which feature rows land where, for chunks that start before, inside and after spans."""
    pixels = torch.zeros(3, 4, 4)
    first, second = ImageSpan(pixels, offset=2, length=4), ImageSpan(pixels, offset=8, length=4)
    # request 0 extends positions 4..9 (cuts both spans); request 1 positions 0..2 (misses hers)
    mm = MultimodalInputs.build(
        [[first, second], [ImageSpan(pixels, offset=5, length=2)]],
        [4, 0],
        [6, 3],
        torch.device("cpu"),
    )
    assert mm is not None and len(mm.images) == 2 and mm.num_feature_rows == 8
    assert mm.src_index.tolist() == [2, 3, 4, 5]  # rows 2-3 of the first, 0-1 of the second
    assert mm.dst_index.tolist() == [0, 1, 4, 5]  # positions 4, 5, 8, 9 of request 0
    assert MultimodalInputs.build([[first]], [6], [1], torch.device("cpu")) is None


def test_multimodal_inputs_take_an_image_once_per_key():
    """The same image (key) in two requests of a forward, and twice in one, is encoded once;
    spans without a key are always their own."""
    pixels = torch.zeros(3, 4, 4)
    a, b = ImageSpan(pixels, 0, 3, key="a"), ImageSpan(pixels, 5, 3, key="a")
    mm = MultimodalInputs.build(
        [[a, b], [ImageSpan(pixels, 1, 3, key="a"), ImageSpan(pixels, 4, 3)]],
        [0, 0], [8, 7], torch.device("cpu"),
    )  # fmt: skip
    assert mm is not None and [s.key for s in mm.images] == ["a", None]
    assert mm.num_feature_rows == 6
    assert mm.src_index.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert mm.dst_index.tolist() == [0, 1, 2, 5, 6, 7, 9, 10, 11, 12, 13, 14]


def _counting_encoder(calls: list[int], width: int = 2):
    def encode(pixels: torch.Tensor) -> torch.Tensor:
        calls.append(pixels.shape[0])  # each image's rows: its first pixel value, 3 times
        return pixels[:, :1, :1, :1].reshape(-1, 1, 1).expand(-1, 3, width).clone()

    return encode


def test_image_feature_cache_encodes_only_what_it_lacks():
    cpu, calls = torch.device("cpu"), []
    encode = _counting_encoder(calls)
    cache = ImageFeatureCache(max_bytes=2 * 3 * 2 * 4)  # room for two images' float32 rows
    one, two, three = (
        ImageSpan(torch.full((3, 4, 4), float(v)), 0, 3, key=str(v)) for v in (1, 2, 3)
    )
    assert cache.features([one, two], encode, cpu)[:, 0].tolist() == [1, 1, 1, 2, 2, 2]
    assert cache.features([two, one], encode, cpu)[:, 0].tolist() == [2, 2, 2, 1, 1, 1]
    assert calls == [2] and (cache.hits, cache.misses) == (2, 2)
    cache.features([three], encode, cpu)  # evicts "2", the least recently used
    assert list(cache.entries) == ["1", "3"] and cache.bytes == 48
    assert cache.features([two, three], encode, cpu)[:, 0].tolist() == [2, 2, 2, 3, 3, 3]
    assert calls == [2, 1, 1]
    unkeyed = ImageSpan(torch.full((3, 4, 4), 5.0), 0, 3)
    cache.features([unkeyed], encode, cpu)
    cache.features([unkeyed], encode, cpu)
    assert calls == [2, 1, 1, 1, 1] and None not in cache.entries


def test_image_feature_cache_of_zero_bytes_keeps_nothing_and_checks_rows():
    cpu, calls = torch.device("cpu"), []
    cache = ImageFeatureCache(max_bytes=0)
    image = ImageSpan(torch.ones(3, 4, 4), 0, 3, key="k")
    cache.features([image], _counting_encoder(calls), cpu)
    cache.features([image], _counting_encoder(calls), cpu)
    assert calls == [1, 1] and not cache.entries and cache.bytes == 0
    with pytest.raises(ValueError, match="3 positions; the vision side gives 2"):
        cache.features([image], lambda px: torch.zeros(px.shape[0], 2, 2), cpu)


def test_loads_the_transformers_4_52_layout(llava, tmp_path):
    """The same tensors under `model.vision_tower.vision_model.*`, `model.language_model.*` and
    `lm_head.*` (what transformers 4.52-4.x saved) load into the same parameters."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, hf, processor = llava
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{path}/{name}", tmp_path / name)
    renamed = {}
    for name, tensor in load_file(f"{path}/model.safetensors").items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        elif name.startswith("vision_tower."):
            name = "model.vision_tower.vision_model." + name.removeprefix("vision_tower.")
        else:
            name = "model." + name
        renamed[name] = tensor
    save_file(renamed, str(tmp_path / "model.safetensors"))
    ids, pixel_values = _prompt(processor, "USER: <image>\nWhat is this? ASSISTANT:", [_image(8)])
    spans = _spans(ids, pixel_values, hf.config.image_token_id)
    logits = []
    for hf_dir in (path, str(tmp_path)):
        drv = Driver(hf_dir)
        row = drv.new_seq()
        logits += drv.extend({row: _hashed(ids, hf.config.image_token_id)}, {row: spans})
    assert torch.equal(logits[0], logits[1])
