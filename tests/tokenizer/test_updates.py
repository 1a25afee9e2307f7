"""Updates: the order of news, the keep-alive tick (on idle waits only, one timer per call),
waiting for a future with ticks, and cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sluice.tokenizer.req_state import ReqState, Updates
from sluice.utils.event_loop import run_loop


def _states(updates: Updates, n: int) -> list[ReqState]:
    return [ReqState(f"r{i}", None, i, updates) for i in range(n)]


@pytest.fixture(params=["uvloop", "asyncio"])
def run(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("SLUICE_UVLOOP", "1" if request.param == "uvloop" else "0")
    return run_loop


def test_news_comes_in_order_each_state_once(run: Any) -> None:
    async def go() -> list[str]:
        updates = Updates()
        a, b, c = _states(updates, 3)
        for state in (b, a, b, c, a):  # b and a again while queued: not twice
            state.notify()
        got = []
        for _ in range(3):
            state = await updates.get()
            assert state is not None
            state.queued = False
            got.append(state.rid)
        a.notify()
        got.append((await updates.get()).rid)
        return got

    assert run(go()) == ["r1", "r0", "r2", "r0"]


def test_a_waiting_consumer_wakes_on_news_and_without_tick_never_times_out(run: Any) -> None:
    async def go() -> tuple[str, bool]:
        updates = Updates()  # no tick
        (state,) = _states(updates, 1)
        getter = asyncio.ensure_future(updates.get())
        await asyncio.sleep(0.05)
        pending = not getter.done()
        state.notify()
        return (await getter).rid, pending

    assert run(go()) == ("r0", True)


def test_an_idle_wait_ticks_after_tick_seconds(run: Any) -> None:
    """No news: each get gives None, never sooner than `tick` after it began waiting."""

    async def go() -> list[tuple[ReqState | None, float]]:
        loop = asyncio.get_running_loop()
        updates = Updates(tick=0.05)
        got = []
        for _ in range(3):
            start = loop.time()
            item = await updates.get()
            got.append((item, loop.time() - start))
        updates.close()
        return got

    for item, waited in run(go()):
        assert item is None and waited >= 0.05 - 0.003, waited


def test_news_never_ticks_and_one_timer_serves_a_busy_stream(run: Any) -> None:
    """200 waits each ended by news (tick 10 s, far longer than the loop): every get gives the
    state, and the same timer handle stays armed across all of them (none made per update)."""

    async def go() -> tuple[list[str | None], int]:
        loop = asyncio.get_running_loop()
        updates = Updates(tick=10.0)
        (state,) = _states(updates, 1)
        got: list[str | None] = []
        timers = set()
        for _ in range(200):
            loop.call_soon(state.notify)
            item = await updates.get()
            if item is not None:
                item.queued = False
            got.append(None if item is None else item.rid)
            timers.add(id(updates._timer))
        updates.close()
        return got, len(timers)

    got, num_timers = run(go())
    assert got == ["r0"] * 200
    assert num_timers == 1


def test_wait_done_ticks_until_the_future_is_done(run: Any) -> None:
    """An unfinished future: False at each tick (news in between is no tick); True once done."""

    async def go() -> list[bool]:
        loop = asyncio.get_running_loop()
        updates = Updates(tick=0.05)
        (state,) = _states(updates, 1)
        fut = loop.create_future()
        loop.call_soon(state.notify)  # news while waiting: not a tick, not an end
        results = []
        while not results or not results[-1]:
            results.append(await updates.wait_done(fut))
            if results.count(False) == 2 and not fut.done():
                loop.call_soon(fut.set_result, 1)
        updates.close()
        return results

    assert run(go()) == [False, False, True]


def test_a_cancelled_get_leaves_no_waiter_and_close_stops_the_timer(run: Any) -> None:
    async def go() -> tuple[bool, bool, str]:
        updates = Updates(tick=10.0)
        (state,) = _states(updates, 1)
        getter = asyncio.ensure_future(updates.get())
        await asyncio.sleep(0.01)
        getter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await getter
        no_waiter = updates._waiter is None
        timer = updates._timer
        updates.close()
        state.notify()  # news after the consumer left: kept, harmless
        return no_waiter, timer is not None and timer.cancelled(), (await updates.get()).rid

    assert run(go()) == (True, True, "r0")
