"""--omp-wait-policy: what the scheduler process sets before torch loads."""

from __future__ import annotations

import os

import pytest

from sluice.config import ServerArgs
from sluice.scheduler.process import set_omp_wait_policy
from sluice.utils.system import available_cpus, omp_wait_policy


@pytest.mark.parametrize(
    ("setting", "num_threads", "env", "expected"),
    [
        ("auto", 0, None, "PASSIVE"),  # 0 threads: every core
        ("auto", 4, None, "PASSIVE"),
        ("auto", 8, None, "PASSIVE"),  # more threads than cores
        ("auto", 3, None, None),  # a core left for the HTTP and detokenizer processes
        ("auto", 0, "ACTIVE", None),  # the environment's value stays
        ("active", 0, None, "ACTIVE"),
        ("passive", 1, "ACTIVE", "PASSIVE"),  # the flag wins over the environment
    ],
)
def test_policy(setting: str, num_threads: int, env: str | None, expected: str | None) -> None:
    assert omp_wait_policy(setting, num_threads, 4, env) == expected


def test_the_process_sets_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "")  # recorded, so the test's changes are undone
    monkeypatch.delenv("OMP_WAIT_POLICY")
    line = set_omp_wait_policy(ServerArgs(omp_wait_policy="auto", num_threads=0))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert f"all {available_cpus()} cores" in line
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    line = set_omp_wait_policy(ServerArgs(omp_wait_policy="auto", num_threads=0))
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "from the environment" in line
    set_omp_wait_policy(ServerArgs(omp_wait_policy="passive"))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_flag_refuses_other_values() -> None:
    with pytest.raises(ValueError, match="omp_wait_policy"):
        ServerArgs(omp_wait_policy="spin")
