"""CPU time of processes from /proc (Linux): how a benchmark tells what each server process
spends per output token.

`cpu_seconds(pid)` is user + system time of the whole process, every thread of it included (the
kernel sums a thread group's times into /proc/PID/stat, threads that ended too). `TreeCpu` takes
a snapshot of a process and its descendants (named by their title, e.g. sluice's
"sluice::scheduler") and of this process, and later gives each one's CPU milliseconds since.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICKS_S = os.sysconf("SC_CLK_TCK")
CLIENT = "client"  # this process, in TreeCpu's results


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after "(comm)" (which may itself hold spaces and parentheses):
    field k of proc(5) is item k - 3; raises OSError when the process is gone."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads); raises OSError when it is gone."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / _TICKS_S  # fields 14 and 15 of proc(5)


def children(pid: int) -> list[int]:
    """The direct children of `pid` (from /proc/PID/task/*/children, else a /proc scan)."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        found = []
        for task in tasks.iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
        return sorted(set(found))
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN
        return [p for p in _all_pids() if _parent(p) == pid]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def name_of(pid: int) -> str:
    """The process's title (its argv[0], which setproctitle sets), without a "sluice::"."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    title = argv[0].decode(errors="replace").strip() or str(pid)
    return title.split()[0].removeprefix("sluice::")


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _parent(pid: int) -> int | None:
    try:
        return int(_stat_fields(pid)[1])  # field 4 of proc(5)
    except OSError:
        return None


class TreeCpu:
    """CPU seconds of `root` and its descendants (by name) and of this process (CLIENT), from
    the moment it is made; processes that share a name are summed, a process that exits is
    left out."""

    def __init__(self, root: int) -> None:
        self.root = root
        self._start = self._snapshot()

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        snap = {}
        for pid in [self.root, *descendants(self.root)]:
            try:
                snap[pid] = (name_of(pid), cpu_seconds(pid))
            except OSError:
                pass
        snap[os.getpid()] = (CLIENT, cpu_seconds(os.getpid()))
        return snap

    def seconds(self) -> dict[str, float]:
        """name -> CPU seconds since the snapshot."""
        out: dict[str, float] = {}
        for pid, (name, now) in self._snapshot().items():
            if pid in self._start:
                out[name] = out.get(name, 0.0) + now - self._start[pid][1]
        return out

    def ms_per(self, count: int) -> dict[str, float]:
        """name -> CPU milliseconds per `count` (output tokens) since the snapshot."""
        return {name: s * 1000 / max(count, 1) for name, s in self.seconds().items()}


def describe(ms: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.3f}" for name, value in sorted(ms.items()))
