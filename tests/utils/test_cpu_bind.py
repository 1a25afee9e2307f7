"""--cpu-bind: the scheduler's compute threads pinned one to a CPU, its other threads off the
first one's. What pins runs in a subprocess: pinning the test process would pin every test
after it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sluice.config import ServerArgs
from sluice.messages import ModelInfo
from sluice.scheduler.process import bind_cpus

TWO_CPUS = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs Linux and 2 CPUs",
)


def _run(code: str) -> str:
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def _info(device: str = "cpu") -> ModelInfo:
    return ModelInfo(
        model_name="m", hf_dir="/m", context_len=8, vocab_size=8, dimensions=8,
        max_total_tokens=8, max_running_requests=1, num_threads=2, device=device,
        dtype="float32",
    )  # fmt: skip


@TWO_CPUS
def test_each_compute_thread_gets_its_own_cpu() -> None:
    out = _run(
        """
        import os, threading, torch
        from sluice.model import kernels
        ops = kernels.cpu_ops()
        torch.set_num_threads(2)
        cpus = sorted(os.sched_getaffinity(0))[:2]
        tids = ops.bind_compute_threads(cpus)
        assert tids[0] == threading.get_native_id(), tids  # thread 0 is the caller
        assert len(set(tids)) == 2
        assert [os.sched_getaffinity(t) for t in tids] == [{cpus[0]}, {cpus[1]}]
        for bad, why in (([cpus[0]], "2 compute threads need as many CPUs"),
                         ([cpus[0], -1], "out of range")):
            try:
                ops.bind_compute_threads(bad)
            except RuntimeError as e:
                assert why in str(e), e
            else:
                raise AssertionError(bad)
        print("OK")
        """
    )
    assert out.strip().endswith("OK")


@TWO_CPUS
def test_the_other_threads_leave_the_first_cpu() -> None:
    # a stand-in for the kernels' binding that pins only the calling thread: the sweep must move
    # a thread started before it and one started after (leave_main_cpu), and not the caller
    out = _run(
        """
        import os, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from sluice.utils import system
        cpus = sorted(os.sched_getaffinity(0))
        before_tid = []
        stop = threading.Event()
        def idle():
            before_tid.append(threading.get_native_id())
            stop.wait()
        threading.Thread(target=idle, daemon=True).start()
        while not before_tid:
            time.sleep(0.01)
        def bind(chosen):
            os.sched_setaffinity(0, {chosen[0]})
            return [threading.get_native_id()]
        line = system.pin_threads(bind, 1)
        spare = set(cpus) - {cpus[0]}
        assert os.sched_getaffinity(0) == {cpus[0]}
        assert os.sched_getaffinity(before_tid[0]) == spare
        with ThreadPoolExecutor(1, initializer=system.leave_main_cpu) as pool:
            assert pool.submit(os.sched_getaffinity, 0).result() == spare
        # without the initializer a new thread takes its creator's one CPU
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(os.sched_getaffinity, 0).result() == {cpus[0]}
        stop.set()
        print(line)
        """
    )
    assert f"compute threads on CPUs [{sorted(os.sched_getaffinity(0))[0]}]" in out


def test_where_nothing_is_pinned_the_line_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_KERNEL_POOL", raising=False)
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert bind_cpus(ServerArgs(cpu_bind="off"), _info()).endswith("the OS places every thread")
    assert "not on the CPU" in bind_cpus(ServerArgs(), _info("cuda:0"))
    monkeypatch.setenv("SLUICE_KERNEL_POOL", "1")
    assert "SLUICE_KERNEL_POOL" in bind_cpus(ServerArgs(), _info())
    if before is not None:  # none of them pinned this process
        assert os.sched_getaffinity(0) == before


def test_one_compute_thread_is_not_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("Linux only")
    monkeypatch.delenv("SLUICE_KERNEL_POOL", raising=False)
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        line = bind_cpus(ServerArgs(), _info())
    finally:
        torch.set_num_threads(threads)
    assert "not pinned" in line and os.sched_getaffinity(0) == before


def test_the_flag_takes_auto_or_off() -> None:
    assert ServerArgs().cpu_bind == "auto"
    with pytest.raises(ValueError, match="cpu_bind"):
        ServerArgs(cpu_bind="on")
