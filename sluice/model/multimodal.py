"""Images in a forward: which positions of the batch take which rows of the images' features.

A request's image occupies a span of placeholder positions in its sequence (`ImageSpan`: from
`offset`, `length` positions, one per feature row the model's vision side gives for it). A
forward extends each request by the positions [prefix_len, prefix_len + extend_len); an image
whose span overlaps that range is encoded in this forward, and only its overlapping rows land,
so a chunked prefill may cut through an image: each chunk takes the rows of its own positions.

An image's features depend on its pixels alone, so they are kept by the image's key (its
sha256) in an `ImageFeatureCache`: a later chunk of the same image, a repeated image, or the same
image twice in one batch runs the vision side once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ImageSpan:
    """One processed image of a request and the positions its features fill."""

    pixel_values: torch.Tensor  # [C, H, W], as the model's processor made it
    offset: int  # position of the image's first placeholder in the request's sequence
    length: int  # placeholder positions = feature rows the model gives for the image
    key: str | None = None  # the image's content hash; None: never cached nor shared

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"bad image span: offset {self.offset}, length {self.length}")


@dataclass
class MultimodalInputs:
    """The images one forward needs, and where their feature rows go.

    `images` holds each image once (two spans with the same key are one image); their features,
    image after image, are rows 0..num_feature_rows-1, and row `src_index[m]` becomes the input
    embedding of row `dst_index[m]` of the batch's tokens (rows of `ForwardBatch.input_ids`).
    `features` is filled by the runner (`ImageFeatureCache.features`) before the model reads it.
    """

    images: list[ImageSpan]  # the images any of whose positions is new here, each once
    num_feature_rows: int  # sum of their span lengths
    src_index: torch.Tensor  # [M] int64, rows of the images' features, image-major
    dst_index: torch.Tensor  # [M] int64, rows of T they fill
    features: torch.Tensor | None = field(default=None, repr=False)  # [num_feature_rows, hidden]

    @classmethod
    def build(
        cls,
        images: list[list[ImageSpan]],
        prefix_lens: list[int],
        extend_lens: list[int],
        device: torch.device,
    ) -> MultimodalInputs | None:
        """`images[b]`: request b's images (all of them; those outside the new positions are
        left out). None when no image has a position in this forward."""
        taken: list[ImageSpan] = []
        first_row: dict[str, int] = {}  # key -> its image's first feature row
        src, dst = [], []
        num_rows = 0  # feature rows of the images taken so far
        start = 0  # row of T of the request's first new token
        for spans, prefix_len, extend_len in zip(images, prefix_lens, extend_lens, strict=True):
            end = prefix_len + extend_len
            for span in spans:
                lo, hi = max(span.offset, prefix_len), min(span.offset + span.length, end)
                if lo >= hi:
                    continue
                row = first_row.get(span.key) if span.key is not None else None
                if row is None:
                    row = num_rows
                    taken.append(span)
                    num_rows += span.length
                    if span.key is not None:
                        first_row[span.key] = row
                src.append(torch.arange(lo - span.offset, hi - span.offset) + row)
                dst.append(torch.arange(lo - prefix_len, hi - prefix_len) + start)
            start += extend_len
        if not taken:
            return None
        return cls(
            images=taken,
            num_feature_rows=num_rows,
            src_index=torch.cat(src).to(device),
            dst_index=torch.cat(dst).to(device),
        )


Encoder = Callable[[torch.Tensor], torch.Tensor]  # pixels [I, C, H, W] -> [I, rows, hidden]


class ImageFeatureCache:
    """The vision side's output per image key, least recently used out first, within
    `max_bytes` (0: nothing kept). Lives in the scheduler process, beside the model."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0  # images found and encoded, since start

    def features(
        self, images: list[ImageSpan], encode: Encoder, device: torch.device
    ) -> torch.Tensor:
        """[sum of the images' lengths, hidden]: each image's feature rows in turn; the images
        not kept are encoded in one call. Raises ValueError when the encoder's rows do not
        match a span's length."""
        found: list[torch.Tensor | None] = [
            None if s.key is None else self.entries.get(s.key) for s in images
        ]
        for span, feats in zip(images, found, strict=True):
            if feats is not None:
                self.entries.move_to_end(span.key)  # type: ignore[arg-type]
        missing = [k for k, feats in enumerate(found) if feats is None]
        self.hits += len(images) - len(missing)
        self.misses += len(missing)
        if missing:
            pixels = torch.stack([images[k].pixel_values for k in missing]).to(device)
            encoded = encode(pixels)  # [len(missing), rows, hidden]
            for k, feats in zip(missing, encoded, strict=True):
                if feats.shape[0] != images[k].length:
                    raise ValueError(
                        f"an image's span has {images[k].length} positions; the vision side "
                        f"gives {feats.shape[0]} features for it"
                    )
                found[k] = feats
                self._keep(images[k].key, feats)
        return torch.cat(found)  # type: ignore[arg-type]

    def _keep(self, key: str | None, feats: torch.Tensor) -> None:
        size = feats.numel() * feats.element_size()
        if key is None or size > self.max_bytes or key in self.entries:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self.entries[key] = feats.clone()  # not a view that holds the whole batch's output
        self.bytes += size
