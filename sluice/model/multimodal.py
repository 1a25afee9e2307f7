"""Images in a forward: which positions of the batch take which rows of the images' features.

A request's image occupies a span of placeholder positions in its sequence (`ImageSpan`: from
`offset`, `length` positions, one per feature row the model's vision side gives for it). A
forward extends each request by the positions [prefix_len, prefix_len + extend_len); an image
whose span overlaps that range is encoded in this forward, and only its overlapping rows land,
so a chunked prefill may cut through an image: each chunk takes the rows of its own positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageSpan:
    """One processed image of a request and the positions its features fill."""

    pixel_values: torch.Tensor  # [C, H, W], as the model's processor made it
    offset: int  # position of the image's first placeholder in the request's sequence
    length: int  # placeholder positions = feature rows the model gives for the image

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"bad image span: offset {self.offset}, length {self.length}")


@dataclass
class MultimodalInputs:
    """The images one forward encodes, and where their feature rows go.

    The vision side turns `pixel_values` into features whose rows, image after image, are
    numbered 0..num_feature_rows-1; row `src_index[m]` becomes the input embedding of row
    `dst_index[m]` of the batch's tokens (rows of `ForwardBatch.input_ids`).
    """

    pixel_values: torch.Tensor  # [I, C, H, W], the images any of whose positions is new here
    num_feature_rows: int  # sum of their span lengths
    src_index: torch.Tensor  # [M] int64, rows of the images' features, image-major
    dst_index: torch.Tensor  # [M] int64, rows of T they fill

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
        pixels, src, dst = [], [], []
        num_rows = 0  # feature rows of the images taken so far
        start = 0  # row of T of the request's first new token
        for spans, prefix_len, extend_len in zip(images, prefix_lens, extend_lens, strict=True):
            end = prefix_len + extend_len
            for span in spans:
                lo, hi = max(span.offset, prefix_len), min(span.offset + span.length, end)
                if lo >= hi:
                    continue
                pixels.append(span.pixel_values)
                src.append(torch.arange(lo - span.offset, hi - span.offset) + num_rows)
                dst.append(torch.arange(lo - prefix_len, hi - prefix_len) + start)
                num_rows += span.length
            start += extend_len
        if not pixels:
            return None
        return cls(
            pixel_values=torch.stack(pixels).to(device),
            num_feature_rows=num_rows,
            src_index=torch.cat(src).to(device),
            dst_index=torch.cat(dst).to(device),
        )
