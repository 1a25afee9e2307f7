"""benchmarks/proc_cpu.py on this process and on a child that burns CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import ModuleType

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def proc_cpu() -> ModuleType:
    return load_benchmark("proc_cpu")


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_seconds_of_this_process_counts_its_threads(proc_cpu: ModuleType) -> None:
    before, process_before = proc_cpu.cpu_seconds(os.getpid()), time.process_time()
    thread = threading.Thread(target=_burn, args=(0.3,))
    thread.start()
    _burn(0.2)
    thread.join()
    spent = proc_cpu.cpu_seconds(os.getpid()) - before
    assert spent >= 0.45  # both threads, at the clock tick's resolution
    assert abs(spent - (time.process_time() - process_before)) < 0.05


def test_tree_cpu_names_each_descendant_and_the_client(proc_cpu: ModuleType) -> None:
    """root (sleeps) -> grandchild titled "sluice::burner" (burns 0.4 s of CPU after 0.5 s)."""
    burn = "import time; time.sleep(0.5); end = time.process_time() + 0.4\n"
    burn += "while time.process_time() < end: pass"
    grandchild = f"exec -a sluice::burner {sys.executable} -c '{burn}'"
    root = subprocess.Popen(["bash", "-c", f"{grandchild} & wait"])
    try:
        # bash forks the grandchild, which is "bash" until its exec: wait for the exec too (a
        # loaded machine took longer than the first look)
        def names() -> list[str]:
            return [proc_cpu.name_of(p) for p in proc_cpu.descendants(root.pid)]

        deadline = time.monotonic() + 10
        while names() != ["burner"] and time.monotonic() < deadline:
            time.sleep(0.05)
        meter = proc_cpu.TreeCpu(root.pid)
        assert names() == ["burner"]
        _burn(0.1)
        root.wait(30)
        ms = meter.ms_per(100)
    finally:
        root.kill()
        root.wait()
    assert set(ms) == {proc_cpu.CLIENT}  # both exited before the last look: left out
    # 0.1 s over 100 tokens, less up to two clock ticks: /proc counts CPU time by the tick (a
    # run measured 0.9 - 1e-15 here, nine ticks of 10 ms)
    assert ms[proc_cpu.CLIENT] >= 0.7


def test_tree_cpu_counts_a_live_descendant(proc_cpu: ModuleType) -> None:
    burn = "import time; time.sleep(0.3); end = time.process_time() + 0.4\n"
    burn += "while time.process_time() < end: pass\ntime.sleep(30)"
    root = subprocess.Popen(["bash", "-c", f"exec -a sluice::burner {sys.executable} -c '{burn}'"])
    try:
        time.sleep(0.1)
        meter = proc_cpu.TreeCpu(root.pid)
        time.sleep(1.2)
        seconds = meter.seconds()
        text = proc_cpu.describe(meter.ms_per(10))
    finally:
        root.kill()
        root.wait()
    assert 0.3 <= seconds["burner"] <= 0.6
    assert text.startswith("burner ") and ", client " in text
