"""A request's images as the scheduler takes them in: `ImageItem`s off the wire → `ImageSpan`s
the forward uses, checked first, so a malformed image ends its own request with a 400 and never
reaches (and fails) a batch.

What is checked: the model has a vision part; each image's (tile's: an item is one tile)
pixels have the shape the vision tower takes and as many bytes as that shape says; spans take
`tokens_per_tile` positions each, in order, without overlap, inside the prompt; and an id lies
outside the vocabulary exactly at the image positions (the invariant the model, the penalties
and the prompt logprobs rely on).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sluice.checkpoint.vision import ImageSlots
from sluice.messages import ImageItem
from sluice.model.multimodal import ImageSpan


def image_spans(
    items: list[ImageItem], input_ids: list[int], slots: ImageSlots | None, vocab_size: int
) -> list[ImageSpan]:
    """The spans of `items`; raises ValueError with the client-facing reason."""
    if slots is None:
        raise ValueError("this model accepts text only; the request has images")
    spans: list[ImageSpan] = []
    end = 0  # first position after the previous image
    for k, item in enumerate(items):
        if item.length != slots.tokens_per_tile:
            raise ValueError(
                f"image {k} takes {item.length} positions; this model's images take "
                f"{slots.tokens_per_tile}"
            )
        if item.offset < end or item.offset + item.length > len(input_ids):
            raise ValueError(f"image {k}'s positions overlap another image or pass the prompt")
        spans.append(ImageSpan(_pixels(item, k, slots), item.offset, item.length, item.hash))
        end = item.offset + item.length
    ids = torch.tensor(input_ids, dtype=torch.int64)
    is_image = torch.zeros(len(input_ids), dtype=torch.bool)
    for span in spans:
        is_image[span.offset : span.offset + span.length] = True
    in_vocab = (ids >= 0) & (ids < vocab_size)
    if bool((in_vocab == is_image).any()):
        raise ValueError(
            f"token ids must be in [0, {vocab_size}) outside the images, and outside it inside"
        )
    return spans


def _pixels(item: ImageItem, k: int, slots: ImageSlots) -> torch.Tensor:
    shape = tuple(item.shape)
    if shape != slots.tile_shape or item.dtype != "float32":
        raise ValueError(
            f"image {k} has pixels of shape {list(shape)} ({item.dtype}); this model takes "
            f"{list(slots.tile_shape)} (float32)"
        )
    if len(item.pixel_values) != 4 * math.prod(shape):
        raise ValueError(f"image {k} has {len(item.pixel_values)} bytes of pixels for {shape}")
    array = np.frombuffer(item.pixel_values, dtype="<f4").reshape(shape)
    return torch.from_numpy(array.copy())  # [C, H, W] float32
