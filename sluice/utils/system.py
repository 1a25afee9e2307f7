"""Facts about the machine a process runs on (usable cores, free memory, native bfloat16), and
where a process's threads run (`pin_threads`)."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

# CPU flags (as /proc/cpuinfo names them) of a native bfloat16 matmul, best first
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def available_cpus() -> int:
    """Cores this process may really use: its affinity mask, capped by a cgroup CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        n = min(n, max(1, math.floor(quota)))
    return max(1, n)


def _cgroup_cpu_quota() -> float | None:
    v2 = Path("/sys/fs/cgroup/cpu.max")
    try:
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1q, v1p = (
            Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
            Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
        )
        if v1q.exists() and v1p.exists():
            quota = int(v1q.read_text())
            return None if quota <= 0 else quota / int(v1p.read_text())
    except (OSError, ValueError):
        return None
    return None


def available_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


@functools.cache
def has_amx_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls with AMX tiles (oneDNN does, through torch)."""
    return "amx_bf16" in cpu_flags()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags; empty where /proc/cpuinfo is missing (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def native_bf16_flag(flags: frozenset[str]) -> str | None:
    """The flag that says this CPU computes bfloat16 matmuls natively (AMX-BF16 or
    AVX512-BF16), or None."""
    return next((f for f in BF16_CPU_FLAGS if f in flags), None)


def omp_wait_policy(setting: str) -> str | None:
    """The OMP_WAIT_POLICY the scheduler process runs with (None, for auto: OpenMP's default, or
    the environment's as given). libgomp's default spins a short while after a parallel region
    and then sleeps; ACTIVE spins without end (the HTTP and detokenizer processes then wait for
    a core to carry each token), PASSIVE sleeps at once (each of a decode step's ~150 regions
    then wakes its threads). On the 2-core Xeon (model 207) the default served a single stream
    at 66.5 tok/s, ACTIVE 24.3 (benchmarks/README.md)."""
    return setting.upper() if setting in ("active", "passive") else None


def pin_threads(compute_tids: list[int], cpus: list[int]) -> frozenset[int]:
    """Move every thread of this process but `compute_tids` (pinned already) to `cpus` but the
    first, the CPU of the thread that runs the scheduler's Python; returns that set, where
    threads made later belong too (they would take their creator's one CPU).

    Why: a woken thread is placed on its waker's core. Unpinned, zmq's I/O thread, woken by the
    send of each step's output, took the core of the scheduler's Python thread, which waited
    0.6-1.1 ms of a 30 ms step for it while the other core's compute thread spun
    (benchmarks/README.md, session 26)."""
    spare = frozenset(cpus) - {cpus[0]}
    for name in os.listdir("/proc/self/task"):
        if int(name) in compute_tids:
            continue
        try:
            os.sched_setaffinity(int(name), spare)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return spare
