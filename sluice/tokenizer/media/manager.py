"""MediaManager: image references of one request → decoded images (`load_images`), or images
processed for the model (`process_images`, with `processor_dir`), each with its content hash.

Owns three resources of the HTTP process, none created before the first image (text-only
traffic never touches them): the fetcher's HTTP session, the worker pool (a process pool, so
image work never holds the GIL the event loop needs; a worker decodes and, for
`process_images`, runs the checkpoint's image processor in the same call), and byte-bounded LRU
caches of results keyed by the sha256 of the image's bytes. That hash is the image's identity
downstream (the radix cache's placeholder ids come from it).

A `data:` URI seen before is answered without decoding its base64: the sha256 of the URI's text
is remembered with the hash of the bytes it decoded to (the same text always decodes to the same
bytes, under the one policy of the process), so a repeated image costs one hash of its text and
two lookups. The same image sent as another text (other base64 line breaks, a URL) is decoded
and hashed as any new reference, and then found in the caches by its bytes' hash.

Cancellation: cancelling `load_images` cancels every fetch (their connections close); a decode
already running in a worker finishes there and its result is dropped, bounded in time by the
pixel limit; a decode not yet started never runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from sluice.tokenizer.media.decode import DecodedImage, decode_image
from sluice.tokenizer.media.fetch import MediaFetcher, Resolve, system_resolve
from sluice.tokenizer.media.policy import MediaError, MediaPolicy
from sluice.tokenizer.media.process import ProcessedImage, process_image
from sluice.utils import ipc

if TYPE_CHECKING:
    from sluice.config import ServerArgs

logger = logging.getLogger(__name__)

_OFF_LOOP_LEN = 1024 * 1024  # bytes hashed in a thread past this (hashlib releases the GIL)
MAX_URI_KEYS = 4096  # data: URIs remembered (their text's hash -> their bytes' hash)


class _Image(Protocol):
    @property
    def hash(self) -> str: ...
    @property
    def nbytes(self) -> int: ...


ImageT = TypeVar("ImageT", bound=_Image)


class ImageCache(Generic[ImageT]):
    """Images (decoded or processed) by hash, least recently used evicted first; at most
    `capacity` bytes of pixels held (an image larger than that is not kept)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held_len = 0
        self._images: OrderedDict[str, ImageT] = OrderedDict()

    def __len__(self) -> int:
        return len(self._images)

    def get(self, image_hash: str) -> ImageT | None:
        image = self._images.get(image_hash)
        if image is not None:
            self._images.move_to_end(image_hash)
        return image

    def put(self, image: ImageT) -> None:
        size = image.nbytes
        if size > self.capacity or image.hash in self._images:
            return
        while self.held_len + size > self.capacity:
            _, old = self._images.popitem(last=False)
            self.held_len -= old.nbytes
        self._images[image.hash] = image
        self.held_len += size


def resolve_num_workers(num_workers: int) -> int:
    """0 (auto): the cores this process may use, at most 4."""
    if num_workers > 0:
        return num_workers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    resolved = max(1, min(4, cores or 1))
    logger.info("--num-media-workers auto: %d decode processes", resolved)
    return resolved


class MediaManager:
    def __init__(
        self,
        policy: MediaPolicy,
        *,
        cache_bytes: int = 256 * 1024 * 1024,
        num_workers: int = 0,
        executor: Executor | None = None,
        resolve: Resolve = system_resolve,
        processor_dir: str | None = None,
        max_uri_keys: int = MAX_URI_KEYS,
    ) -> None:
        """`executor` (tests: a thread pool) replaces the process pool, and is not shut down
        by `close()`; `resolve` replaces DNS; `processor_dir`: the checkpoint whose image
        processor `process_images` runs; `max_uri_keys`: data: URIs remembered."""
        self.policy = policy
        self.fetcher = MediaFetcher(policy, resolve)
        self.cache: ImageCache[DecodedImage] = ImageCache(cache_bytes)
        self.processed_cache: ImageCache[ProcessedImage] = ImageCache(cache_bytes)
        self.processor_dir = processor_dir
        # sha256 of a data: URI's text -> sha256 of its bytes; least recently used out first
        self.uri_hashes: OrderedDict[str, str] = OrderedDict()
        self.max_uri_keys = max_uri_keys
        self.num_fetched = 0  # references fetched or base64-decoded (no cache answered them)
        self._num_workers = num_workers
        self._executor = executor
        self._owns_executor = executor is None

    @classmethod
    def from_args(cls, args: ServerArgs, processor_dir: str | None = None) -> MediaManager:
        return cls(
            MediaPolicy.from_args(args),
            cache_bytes=args.media_cache_mb * 1024 * 1024,
            num_workers=args.num_media_workers,
            processor_dir=processor_dir,
        )

    @property
    def is_pool_started(self) -> bool:
        return self._executor is not None

    async def load_images(self, urls: Sequence[str]) -> list[DecodedImage]:
        """All images of one request, decoded, in order; the first refusal cancels the
        others."""
        return await self._gather(self.load_image, urls)

    async def process_images(self, urls: Sequence[str]) -> list[ProcessedImage]:
        """All images of one request as the model takes them (`processor_dir`'s processor),
        in order; the first refusal cancels the others. More tiles in all than the policy
        allows is a refusal (their pixels stay in the cache)."""
        images = await self._gather(self.process_image, urls)
        num_tiles = sum(len(image.tiles) for image in images)
        self.policy.check_num_tiles(num_tiles, len(images), sum(i.nbytes for i in images))
        return images

    async def load_image(self, url: str) -> DecodedImage:
        return await self._load(url, self.cache, decode_image)

    async def process_image(self, url: str) -> ProcessedImage:
        assert self.processor_dir is not None, "process_image needs a processor_dir"
        work = partial(process_image, model_dir=self.processor_dir)
        return await self._load(url, self.processed_cache, work)

    async def close(self) -> None:
        await self.fetcher.close()
        if self._owns_executor and self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def _gather(self, load: Any, urls: Sequence[str]) -> list[Any]:
        self.policy.check_num_images(len(urls))
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(load(url)) for url in urls]
        except BaseExceptionGroup as group_error:
            raise _first_error(group_error) from None
        return [task.result() for task in tasks]

    async def _load(self, url: str, cache: ImageCache[ImageT], work: Any) -> ImageT:
        """Fetch, hash, and (on a cache miss) run `work(data, hash, max_pixels)` in a worker;
        a data: URI seen before whose image is still cached is neither decoded nor hashed."""
        uri_key = await _hash(url.encode("utf-8", "surrogatepass")) if _is_data_uri(url) else None
        if uri_key is not None:
            known = self.uri_hashes.get(uri_key)
            cached = cache.get(known) if known is not None else None
            if cached is not None:
                self.uri_hashes.move_to_end(uri_key)
                return cached
        data = await self.fetcher.fetch(url)
        self.num_fetched += 1
        image_hash = await _hash(data)
        if uri_key is not None:
            self._remember_uri(uri_key, image_hash)
        cached = cache.get(image_hash)
        if cached is not None:
            return cached
        image = await self._in_worker(work, data, image_hash)
        cache.put(image)
        return image

    def _remember_uri(self, uri_key: str, image_hash: str) -> None:
        self.uri_hashes[uri_key] = image_hash
        self.uri_hashes.move_to_end(uri_key)
        while len(self.uri_hashes) > self.max_uri_keys:
            self.uri_hashes.popitem(last=False)

    async def _in_worker(self, work: Any, data: bytes, image_hash: str) -> Any:
        loop = asyncio.get_running_loop()
        executor = self._get_executor()
        max_pixels = self.policy.max_image_pixels
        try:
            return await loop.run_in_executor(executor, work, data, image_hash, max_pixels)
        except BrokenProcessPool:
            # a worker died (a decoder crash or the OOM killer): a fresh pool for the next image
            logger.warning("a media decode process died; the pool is restarted")
            if self._owns_executor and self._executor is executor:
                self._executor = None
                executor.shutdown(wait=False, cancel_futures=True)
            raise MediaError(
                "image_url: the image could not be decoded (the decoder died)"
            ) from None

    def _get_executor(self) -> Executor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                resolve_num_workers(self._num_workers),
                mp_context=multiprocessing.get_context("spawn"),  # no fork of a threaded loop
                # a pool process waits for work forever: it goes with its HTTP process, however
                # that one ends (a stop signal's os._exit skips `close`)
                initializer=ipc.die_with_parent,
            )
        return self._executor


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _hash(data: bytes) -> str:
    """sha256 of `data`, hex; in a thread past _OFF_LOOP_LEN (the event loop keeps going)."""
    if len(data) > _OFF_LOOP_LEN:
        return await asyncio.to_thread(_sha256, data)
    return _sha256(data)


def _is_data_uri(url: str) -> bool:
    return url[:5].lower() == "data:"


def _first_error(group_error: BaseExceptionGroup) -> BaseException:
    """The first MediaError of a TaskGroup's failure, else its first non-cancellation error."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group_error]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = exc.exceptions
        elif not isinstance(exc, asyncio.CancelledError):
            leaves.append(exc)
    media = [e for e in leaves if isinstance(e, MediaError)]
    return (media or leaves or [group_error])[0]
