"""run_loop: uvloop when installed and not turned off, asyncio's loop otherwise, and signals
during the run behave as under asyncio.run."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from sluice.utils.event_loop import run_loop

uvloop = pytest.importorskip("uvloop")


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_uvloop_by_default_and_asyncio_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_loop(_loop_type()) is uvloop.Loop
    monkeypatch.setenv("SLUICE_UVLOOP", "0")
    assert not issubclass(run_loop(_loop_type()), uvloop.Loop)


def test_the_result_and_an_exception_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fail() -> None:
        raise ValueError("x")

    async def value() -> int:
        await asyncio.sleep(0)
        return 3

    assert run_loop(value()) == 3
    with pytest.raises(ValueError):
        run_loop(fail())


# a start-up in a thread, as launch.py's: a signal cancels it, and it is let finish
_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, signal, sys, threading, time
    from sluice.utils.event_loop import run_loop

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    log = []

    async def main():
        start = asyncio.get_running_loop().run_in_executor(None, time.sleep, 1.0)
        try:
            await asyncio.shield(start)
        except asyncio.CancelledError:
            await start
            log.append("start undone")
            raise
        return "served"

    threading.Timer(0.3, os.kill, (os.getpid(), int(sys.argv[1]))).start()
    try:
        log.append(run_loop(main()))
    except KeyboardInterrupt:
        log.append("interrupted")
    print(log)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("use_uvloop", ["1", "0"])
def test_a_signal_during_start_up_cancels_then_interrupts(sig: int, use_uvloop: str) -> None:
    env = {**os.environ, "SLUICE_UVLOOP": use_uvloop}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(int(sig))], env=env, capture_output=True,
        text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['start undone', 'interrupted']"
