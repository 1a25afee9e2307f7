"""Placeholders → image positions: a tokenized prompt's image tokens become the positions its
images take, and the ids the scheduler (and its radix cache) sees there.

An image is one or more tiles (sluice.checkpoint.vision): LLaVA's image is one tile; an
Idefics3 / SmolVLM image is a grid of tiles and the global image, with the processor's marker
tokens between them (sluice.tokenizer.image_grid), ordinary tokens of the prompt.

Guarantees:
- each tile occupies `tokens_per_tile` consecutive positions, from an explicit `offset` that
  travels with it (adjacent tiles are never told apart by ids alone);
- the ids of those positions come from the tile's hash alone (`image_ids`, `tile_hash`: the
  image's sha256 and the tile's index), so two requests with the same image share them (a
  prefix-cache hit) and two different images or tiles never do;
- every such id is at least `vocab_size` and below 2**31, and no other position's id is: an id
  outside the vocabulary marks an image position, which the scheduler checks at intake and the
  model, the sampler's penalties and the prompt logprobs skip;
- the "display" ids (what the HTTP process keeps for the request, e.g. to pair prompt logprobs
  with ids) hold the image token at those positions instead, inside the vocabulary.

A prompt names each image with one image token (`<image>`), in the order of the images; the
expansion gives the token sequence the model's transformers processor gives. A prompt already
expanded by that processor (`tokens_per_tile` image tokens per tile, e.g. /generate input_ids
from transformers) is taken as well: its runs of image tokens become the tiles in place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.checkpoint.model_config import ModelConfig
from sluice.checkpoint.vision import ImageSlots
from sluice.messages import ImageItem
from sluice.tokenizer.image_grid import TILE, GridMarkers
from sluice.tokenizer.media.manager import MediaManager
from sluice.tokenizer.media.process import ProcessedImage, load_image_processor
from sluice.tokenizer.normalize import RequestError

if TYPE_CHECKING:
    from sluice.config import ServerArgs

MAX_IMAGE_ID = 2**31 - 1  # ids stay int32-safe in every tensor that holds them


def image_ids(image_hash: str, length: int, vocab_size: int) -> list[int]:
    """The ids of an image's `length` positions: the eight 32-bit words of its sha256, in turn,
    mapped into [vocab_size, MAX_IMAGE_ID)."""
    digest = bytes.fromhex(image_hash)
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, len(digest), 4)]
    room = MAX_IMAGE_ID - vocab_size
    return [vocab_size + words[j % len(words)] % room for j in range(length)]


@dataclass(frozen=True)
class ExpandedPrompt:
    input_ids: list[int]  # what the scheduler gets: image positions hold `image_ids`
    display_ids: list[int]  # the same, with the image token at image positions
    images: list[ImageItem]  # in order of offset


def tile_hash(image: ProcessedImage, k: int) -> str:
    """The identity of tile `k` of `image`: the image's hash for an image of one tile, else the
    sha256 of the image's hash and the tile's index (so the radix cache tells tiles apart)."""
    if len(image.tiles) == 1:
        return image.hash
    return hashlib.sha256(f"{image.hash}:tile:{k}".encode()).hexdigest()


def image_item(image: ProcessedImage, k: int, offset: int, length: int) -> ImageItem:
    pixels = image.tiles[k]
    return ImageItem(
        hash=tile_hash(image, k), offset=offset, length=length,
        pixel_values=pixels.astype("<f4", copy=False).tobytes(), shape=list(pixels.shape),
    )  # fmt: skip


@dataclass(frozen=True)
class _Unit:
    """`taken` ids of the prompt from `start` become `template` (`TILE`: a tile's positions,
    for `tiles` in turn)."""

    start: int
    taken: int
    template: list[int]
    tiles: list[tuple[ProcessedImage, int]]


def expand_images(
    ids: list[int],
    images: list[ProcessedImage],
    slots: ImageSlots,
    vocab_size: int,
    param: str,
    markers: GridMarkers | None = None,
) -> ExpandedPrompt:
    """Expand the image tokens of `ids` (in the vocabulary, already checked) for `images`;
    a 400 when their numbers do not match. `markers`: the tokenizer's, for "grid" tiling."""
    token, per_tile = slots.image_token_id, slots.tokens_per_tile
    positions = [i for i, t in enumerate(ids) if t == token]
    tiles = [(image, k) for image in images for k in range(len(image.tiles))]
    if len(positions) == len(tiles) * per_tile and per_tile > 1 and tiles:
        runs = positions[::per_tile]
        if all(
            positions[k * per_tile + per_tile - 1] == r + per_tile - 1 for k, r in enumerate(runs)
        ):
            units = [
                _Unit(r, per_tile, [TILE], [tile]) for r, tile in zip(runs, tiles, strict=True)
            ]
            return _expand(ids, units, per_tile, token, vocab_size)
    if len(positions) != len(images):
        raise RequestError(
            f"the prompt has {len(positions)} image placeholders for {len(images)} images; "
            "each image needs one image token where it goes",
            param=param,
        )
    units = []
    for pos, image in zip(positions, images, strict=True):
        template = [TILE] if slots.tiling == "whole" else _grid_template(image, markers, param)
        units.append(_Unit(pos, 1, template, [(image, k) for k in range(len(image.tiles))]))
    return _expand(ids, units, per_tile, token, vocab_size)


def _grid_template(image: ProcessedImage, markers: GridMarkers | None, param: str) -> list[int]:
    assert markers is not None, "grid tiling needs the tokenizer's markers"
    try:
        template = markers.template(*image.grid)
    except ValueError as e:
        raise RequestError(f"image_url: {e}", param=param) from None
    if template.count(TILE) != len(image.tiles):
        raise RequestError(
            f"image_url: the processor gave {len(image.tiles)} tiles for a grid of "
            f"{image.grid[0]}x{image.grid[1]}",
            param=param,
        )
    return template


def _expand(
    ids: list[int], units: list[_Unit], per_tile: int, token: int, vocab_size: int
) -> ExpandedPrompt:
    """Replace each unit's ids by its template, each tile by its `per_tile` positions."""
    out: list[int] = []
    display: list[int] = []
    items: list[ImageItem] = []
    prev = 0
    for unit in units:
        out += ids[prev : unit.start]
        display += ids[prev : unit.start]
        tiles = iter(unit.tiles)
        for t in unit.template:
            if t != TILE:
                out.append(t)
                display.append(t)
                continue
            image, k = next(tiles)
            items.append(image_item(image, k, len(out), per_tile))
            out += image_ids(items[-1].hash, per_tile, vocab_size)
            display += [token] * per_tile
        prev = unit.start + unit.taken
    out += ids[prev:]
    display += ids[prev:]
    return ExpandedPrompt(out, display, items)


def image_data_per_prompt(image_data: Any, num_prompts: int, is_single: bool) -> list[list[str]]:
    """`image_data` (GenerateReqInput's) as one list of references per prompt."""
    if image_data is None:
        return [[] for _ in range(num_prompts)]
    if is_single:
        refs = [image_data] if isinstance(image_data, str) else image_data
        per_prompt = [refs]
    elif not isinstance(image_data, list) or len(image_data) != num_prompts:
        raise RequestError(
            f"image_data for a batch of {num_prompts} prompts needs one entry per prompt",
            param="image_data",
        )
    else:
        per_prompt = [[] if d is None else [d] if isinstance(d, str) else d for d in image_data]
    for refs in per_prompt:
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
            raise RequestError(
                "image_data must hold image URLs or data: URIs (strings)", param="image_data"
            )
    return per_prompt


class PromptImages:
    """The TokenizerManager's image side, for a vision-language model: the media manager (its
    worker pool runs the checkpoint's image processor) and the placeholder expansion."""

    def __init__(self, args: ServerArgs, cfg: ModelConfig, slots: ImageSlots, tokenizer: Any):
        load_image_processor(cfg.hf_dir)  # fail at start-up, not at the first image
        self.slots = slots
        self.vocab_size = cfg.vocab_size
        self.image_token: str = tokenizer.convert_ids_to_tokens(slots.image_token_id)
        self.markers = GridMarkers.from_tokenizer(tokenizer) if slots.tiling == "grid" else None
        self.media = MediaManager.from_args(args, processor_dir=cfg.hf_dir)

    async def load(self, refs: list[list[str]]) -> list[list[ProcessedImage]]:
        """The images of every prompt, processed; the first refusal cancels the others."""
        self.media.policy.check_num_images(sum(len(r) for r in refs))
        flat = await self.media.process_images([r for prompt in refs for r in prompt])
        out, start = [], 0
        for prompt in refs:
            out.append(flat[start : start + len(prompt)])
            start += len(prompt)
        return out

    def expand(self, ids: list[int], images: list[ProcessedImage], param: str) -> ExpandedPrompt:
        return expand_images(ids, images, self.slots, self.vocab_size, param, self.markers)

    async def close(self) -> None:
        await self.media.close()
