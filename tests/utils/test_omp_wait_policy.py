"""--omp-wait-policy: what the scheduler process sets before torch loads."""

from __future__ import annotations

import os

import pytest

from sluice.config import ServerArgs
from sluice.scheduler.process import set_omp_wait_policy
from sluice.utils.system import omp_wait_policy


@pytest.mark.parametrize(
    ("setting", "expected"),
    [("auto", None), ("active", "ACTIVE"), ("passive", "PASSIVE")],
)
def test_policy(setting: str, expected: str | None) -> None:
    assert omp_wait_policy(setting) == expected


def test_the_process_sets_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "")  # recorded, so the test's changes are undone
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.delenv("SLUICE_KERNEL_POOL", raising=False)
    auto = ServerArgs(omp_wait_policy="auto")
    line = set_omp_wait_policy(auto, kernel_pool=True)  # OpenMP's own way by default
    assert "OMP_WAIT_POLICY" not in os.environ and "OpenMP's default" in line
    monkeypatch.setenv("SLUICE_KERNEL_POOL", "1")  # an encoder's kernels take no pool
    line = set_omp_wait_policy(auto, kernel_pool=False)
    assert "OMP_WAIT_POLICY" not in os.environ and "OpenMP's default" in line
    line = set_omp_wait_policy(auto, kernel_pool=True)  # a decoder's: torch's threads sleep
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "SLUICE_KERNEL_POOL" in line
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    line = set_omp_wait_policy(auto, kernel_pool=True)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "from the environment" in line
    line = set_omp_wait_policy(ServerArgs(omp_wait_policy="passive"), kernel_pool=False)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and line.endswith("passive")  # the flag


def test_the_flag_refuses_other_values() -> None:
    with pytest.raises(ValueError, match="omp_wait_policy"):
        ServerArgs(omp_wait_policy="spin")
