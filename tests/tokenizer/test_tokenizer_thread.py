"""TokenizerThread: its count of unfinished calls, which lets the loop encode short texts."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sluice.tokenizer.tokenizer_thread import TokenizerThread


def test_idle_only_once_every_call_returned() -> None:
    thread = TokenizerThread("test-tokenize")

    async def go() -> None:
        release = threading.Event()
        first = asyncio.wrap_future(thread.submit(release.wait))
        second = asyncio.wrap_future(thread.submit(lambda: 7))  # queued behind the first
        assert not thread.is_idle()
        release.set()
        assert await first is True
        assert await second == 7
        assert thread.is_idle()  # the count falls in the thread, before the loop hears

        def fail() -> None:
            raise ValueError("bad text")

        with pytest.raises(ValueError, match="bad text"):
            await asyncio.wrap_future(thread.submit(fail))
        assert thread.is_idle()

    try:
        asyncio.run(go())
    finally:
        thread.shutdown(wait=True)


def test_a_cancelled_queued_call_is_not_counted() -> None:
    thread = TokenizerThread("test-tokenize")
    release = threading.Event()
    running = thread.submit(release.wait)
    queued = thread.submit(lambda: None)
    assert queued.cancel() and not thread.is_idle()  # the running call still counts
    release.set()
    running.result()
    thread.shutdown(wait=True)  # every callback has run once the thread is joined
    assert thread.is_idle()
