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


def test_idle_waits_tick_and_busy_ones_do_not(run: Any) -> None:
    """tick 0.1 s: news every 0.01 s for 0.3 s gives no None, and the timer fires about once
    per tick, not once per update; then 0.35 s idle gives three Nones."""

    async def go() -> tuple[list[str | None], int]:
        loop = asyncio.get_running_loop()
        updates = Updates(tick=0.1)
        (state,) = _states(updates, 1)
        calls = 0
        on_timer = updates._on_timer

        def counting(loop: Any) -> None:
            nonlocal calls
            calls += 1
            on_timer(loop)

        updates._on_timer = counting  # type: ignore[method-assign]

        async def produce() -> None:
            for _ in range(30):
                await asyncio.sleep(0.01)
                state.notify()

        producer = asyncio.ensure_future(produce())
        got: list[str | None] = []
        start = loop.time()
        while loop.time() - start < 0.65:
            item = await updates.get()
            if item is not None:
                item.queued = False
            got.append(None if item is None else item.rid)
        await producer
        updates.close()
        return got, calls

    got, timer_calls = run(go())
    news, rest = got[:30], got[30:]
    assert news == ["r0"] * 30
    assert rest and all(x is None for x in rest) and 2 <= len(rest) <= 4, got
    assert timer_calls <= len(rest) + 5  # about 3 (0.3 s / tick) while busy, 1 per idle tick


def test_wait_done_ticks_until_the_future_is_done(run: Any) -> None:
    async def go() -> list[bool]:
        loop = asyncio.get_running_loop()
        updates = Updates(tick=0.05)
        (state,) = _states(updates, 1)
        fut = loop.create_future()
        loop.call_later(0.18, fut.set_result, 1)
        loop.call_later(0.01, state.notify)  # news while waiting is no tick
        results = []
        while not results or not results[-1]:
            results.append(await updates.wait_done(fut))
        updates.close()
        return results

    results = run(go())
    assert results[-1] is True and 2 <= results.count(False) <= 4, results


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
