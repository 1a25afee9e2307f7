"""The event loop of the HTTP processes: uvloop when it is installed, else asyncio's own.

uvloop does less work per ready callback and per socket read than asyncio's selector loop, and
the HTTP process wakes several times per streamed token; SLUICE_UVLOOP=0 keeps asyncio's loop.
`run_loop` is `asyncio.run` with that loop: the same asyncio.Runner, so SIGINT cancels the main
task and then raises KeyboardInterrupt, exactly as under `asyncio.run`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from sluice.utils import envs

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None (asyncio's default loop)."""
    if not envs.get_bool("SLUICE_UVLOOP"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a new event loop (see the module docstring)."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
