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
from sluice.scheduler.process import CpuBinding

LINUX = hasattr(os, "sched_getaffinity")
TWO_CPUS = pytest.mark.skipif(
    not LINUX or len(os.sched_getaffinity(0)) < 2, reason="pinning needs Linux and 2 CPUs"
)


def _run(code: str) -> str:
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@TWO_CPUS
def test_each_compute_thread_gets_its_own_cpu() -> None:
    out = _run(
        """
        import os, threading, torch
        from sluice.model import kernels
        ops = kernels.cpu_ops()
        if ops is None:
            print("NO KERNELS")
            raise SystemExit
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
    if "NO KERNELS" in out:
        pytest.skip("sluice's CPU kernels are not built here")
    assert out.strip().endswith("OK")


@TWO_CPUS
def test_the_other_threads_leave_the_first_cpu() -> None:
    # the first thread pinned by hand, a second one standing for another compute thread: the
    # sweep moves a thread started before it, and leaves both of those as they are
    out = _run(
        """
        import os, threading, time
        from sluice.utils.system import pin_threads
        cpus = sorted(os.sched_getaffinity(0))
        tids, stop = {}, threading.Event()
        def idle(name):
            tids[name] = threading.get_native_id()
            stop.wait()
        for name in ("compute", "other"):
            threading.Thread(target=idle, args=(name,), daemon=True).start()
        while len(tids) < 2:
            time.sleep(0.01)
        os.sched_setaffinity(0, {cpus[0]})
        os.sched_setaffinity(tids["compute"], {cpus[-1]})
        spare = pin_threads([threading.get_native_id(), tids["compute"]], cpus)
        assert spare == set(cpus) - {cpus[0]}
        assert os.sched_getaffinity(0) == {cpus[0]}
        assert os.sched_getaffinity(tids["compute"]) == {cpus[-1]}
        assert os.sched_getaffinity(tids["other"]) == spare
        stop.set()
        print("OK")
        """
    )
    assert out.strip() == "OK"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The variables a plan reads or sets, recorded so that the test's changes are undone."""
    for var in ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "SLUICE_KERNEL_POOL"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    return monkeypatch


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_a_plan_pins_two_threads_that_have_the_cpus_to_themselves(env: pytest.MonkeyPatch) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus)
    not_pinned = {
        "the OS places every thread": ServerArgs(cpu_bind="off", num_threads=n),
        "not on the CPU": ServerArgs(device="cuda", num_threads=n),
        f"{n + 1} compute threads on {n} CPUs": ServerArgs(num_threads=n + 1),
        "1 compute thread": ServerArgs(num_threads=1),
    }
    if n > 2:
        not_pinned[f"{n} compute threads: pinned only with 2"] = ServerArgs(num_threads=n)
    for why, args in not_pinned.items():
        plan = CpuBinding.plan(args)
        assert plan.cpus is None and why in plan.reason, (why, plan)
    env.setenv("SLUICE_KERNEL_POOL", "1")
    assert "SLUICE_KERNEL_POOL" in CpuBinding.plan(ServerArgs(num_threads=n)).reason
    env.delenv("SLUICE_KERNEL_POOL")
    env.setenv("OMP_PROC_BIND", "spread")  # the user's own placement stays
    assert "OMP_PROC_BIND is set" in CpuBinding.plan(ServerArgs(num_threads=n)).reason
    env.delenv("OMP_PROC_BIND")
    if n == 2:
        assert CpuBinding.plan(ServerArgs()).cpus == cpus
        assert "OMP_PLACES" not in os.environ  # OpenMP is left to its own placement


def test_where_nothing_is_pinned_the_line_says_why() -> None:
    info = ModelInfo(
        model_name="m", hf_dir="/m", context_len=8, vocab_size=8, dimensions=8,
        max_total_tokens=8, max_running_requests=1, num_threads=2, device="cpu",
        dtype="float32",
    )  # fmt: skip
    line = CpuBinding("auto", None, "not pinned (1 compute thread)").pin(info, None)
    assert line == "--cpu-bind auto: not pinned (1 compute thread)"


def test_the_flag_takes_auto_or_off() -> None:
    assert ServerArgs().cpu_bind == "auto"
    with pytest.raises(ValueError, match="cpu_bind"):
        ServerArgs(cpu_bind="on")
