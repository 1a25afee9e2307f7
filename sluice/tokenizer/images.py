"""Placeholders → image positions: a tokenized prompt's image tokens become the positions its
images take, and the ids the scheduler (and its radix cache) sees there.

Guarantees:
- each image occupies `tokens_per_image` consecutive positions, from an explicit `offset` that
  travels with it (adjacent images are never told apart by ids alone);
- the ids of those positions come from the image's sha256 alone (`image_ids`), so two requests
  with the same image share them (a prefix-cache hit) and two different images never do;
- every such id is at least `vocab_size` and below 2**31, and no other position's id is: an id
  outside the vocabulary marks an image position, which the scheduler checks at intake and the
  model, the sampler's penalties and the prompt logprobs skip;
- the "display" ids (what the HTTP process keeps for the request, e.g. to pair prompt logprobs
  with ids) hold the image token at those positions instead, inside the vocabulary.

A prompt names each image with one image token (`<image>` for LLaVA), in the order of the
images; a prompt already expanded as the model's processor does it (`tokens_per_image` image
tokens per image, e.g. /generate input_ids from transformers) is taken as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.checkpoint.model_config import ModelConfig
from sluice.checkpoint.vision import ImageSlots
from sluice.messages import ImageItem
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


def image_item(image: ProcessedImage, offset: int, length: int) -> ImageItem:
    pixels = image.pixel_values
    return ImageItem(
        hash=image.hash, offset=offset, length=length,
        pixel_values=pixels.astype("<f4", copy=False).tobytes(), shape=list(pixels.shape),
    )  # fmt: skip


def expand_images(
    ids: list[int], images: list[ProcessedImage], slots: ImageSlots, vocab_size: int, param: str
) -> ExpandedPrompt:
    """Expand the image tokens of `ids` (in the vocabulary, already checked) for `images`;
    a 400 when their numbers do not match."""
    token, per_image = slots.image_token_id, slots.tokens_per_image
    positions = [i for i, t in enumerate(ids) if t == token]
    if len(positions) == len(images) * per_image and per_image > 1 and images:
        runs = [positions[k * per_image] for k in range(len(images))]
        if all(
            positions[k * per_image + per_image - 1] == r + per_image - 1
            for k, r in enumerate(runs)
        ):
            return _expand(ids, images, runs, per_image, token, vocab_size, taken=per_image)
    if len(positions) != len(images):
        raise RequestError(
            f"the prompt has {len(positions)} image placeholders for {len(images)} images; "
            "each image needs one image token where it goes",
            param=param,
        )
    return _expand(ids, images, positions, per_image, token, vocab_size, taken=1)


def _expand(
    ids: list[int],
    images: list[ProcessedImage],
    starts: list[int],
    per_image: int,
    token: int,
    vocab_size: int,
    taken: int,
) -> ExpandedPrompt:
    """Replace the `taken` ids at each of `starts` by the image's `per_image` positions."""
    out: list[int] = []
    display: list[int] = []
    items: list[ImageItem] = []
    prev = 0
    for start, image in zip(starts, images, strict=True):
        out += ids[prev:start]
        display += ids[prev:start]
        items.append(image_item(image, len(out), per_image))
        out += image_ids(image.hash, per_image, vocab_size)
        display += [token] * per_image
        prev = start + taken
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
        return expand_images(ids, images, self.slots, self.vocab_size, param)

    async def close(self) -> None:
        await self.media.close()
