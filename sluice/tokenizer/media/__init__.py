"""The HTTP process's image input: fetch under a safety policy, decode under limits, cache by hash.

`MediaManager.load_images(urls)` is the entry point; every refusal is a `MediaError` (a 400
`RequestError` whose message says why, with the numbers). Images still reach no model: the chat
path refuses image parts for text-only models until a vision-language model is supported.
"""

from __future__ import annotations

from sluice.tokenizer.media.decode import FORMATS, DecodedImage
from sluice.tokenizer.media.manager import ImageCache, MediaManager
from sluice.tokenizer.media.policy import MediaError, MediaPolicy

__all__ = ["FORMATS", "DecodedImage", "ImageCache", "MediaError", "MediaManager", "MediaPolicy"]
