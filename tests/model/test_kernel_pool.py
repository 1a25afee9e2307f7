"""The kernels' thread pool (`sluice/model/kernels/parallel.h`): results that do not depend on
the number of threads, calls that finish without the workers (held by a test hook, as a worker
that is never scheduled), calls from two Python threads, no CPU burnt while idle, one pool for
both kernel modules, and a build key that covers the header."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from sluice.model import kernels

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def cpu():
    ops = kernels.cpu_ops()
    assert ops is not None, "the CPU kernels did not build (see the warning log)"
    ops._pool_enable(True)  # off by default (SLUICE_KERNEL_POOL): on for these tests
    yield ops
    ops._pool_enable(kernels.pool_wanted())


@pytest.fixture(scope="module")
def quant(cpu):
    ops = kernels.quant_ops()
    assert ops is not None, "the quantized-weight kernels did not build"
    return ops


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _blocks(n: int, k: int, qtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * k)
    return torch.from_numpy(quantize(torch.randn(n, k, generator=g).numpy(), qtype))


def _kernel_calls(cpu, quant) -> dict[str, object]:
    """One call of each kernel family, on shapes big enough to be cut into several chunks:
    name -> a function of no arguments giving its output."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 576, generator=g, dtype=torch.float32).bfloat16()
    w = torch.randn(1000, 576, generator=g).bfloat16()
    rows = torch.randn(64, 576, generator=g).bfloat16()
    norm_w = torch.randn(576, generator=g).bfloat16()
    gate_up = torch.randn(64, 2 * 1536, generator=g).bfloat16()
    # decode attention: 8 queries (one task per query at 1 and 2 threads: the same partition)
    q = torch.randn(8, 9, 64, generator=g).bfloat16()
    k_pool, v_pool = (torch.randn(4096, 3, 64, generator=g).bfloat16() for _ in range(2))
    idx = torch.randperm(4096, generator=g)[: 8 * 300].view(8, 300)
    lens = torch.tensor([300, 1, 77, 256, 299, 5, 128, 200])
    blocks = _blocks(1536, 576, T.Q4_1)
    many = torch.randn(64, 576, generator=g).bfloat16()
    calls = {
        "small_linear": lambda: cpu.small_linear(x, w),
        "rms_norm": lambda: cpu.rms_norm(rows, norm_w, 1e-5),
        "silu_and_mul": lambda: cpu.silu_and_mul(gate_up),
        "decode_attention": lambda: cpu.decode_attention(q, k_pool, v_pool, idx, lens, 0.125),
        "quant_linear": lambda: quant.quant_linear(x, blocks, int(T.Q4_1)),
        "quant_linear_int8": lambda: quant.quant_linear(
            x, blocks, int(T.Q4_1), int8_activations=True
        ),
        "quant_gemm": lambda: quant.quant_linear(many, blocks, int(T.Q4_1)),
        "dequantize": lambda: quant.dequantize(blocks, int(T.Q4_1), 576, torch.bfloat16),
    }
    if quant.packed_gemm:
        packed = quant.repack(blocks, int(T.Q4_1), 576)
        calls["packed_linear"] = lambda: quant.packed_linear(many, packed, 1536)
    return calls


def _outputs(calls: dict[str, object], threads: int) -> dict[str, torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {name: call() for name, call in calls.items()}
    finally:
        torch.set_num_threads(before)


def test_results_are_the_same_bits_on_one_and_two_threads_and_with_openmp(cpu, quant) -> None:
    calls = _kernel_calls(cpu, quant)
    jobs = cpu._pool_stats()["jobs"]
    one, two = _outputs(calls, 1), _outputs(calls, 2)
    assert cpu._pool_stats()["jobs"] >= jobs + len(calls)  # two threads did go through the pool
    for name in calls:
        assert torch.equal(one[name], two[name]), name
    cpu._pool_enable(False)  # at::parallel_for, as before the pool
    try:
        openmp = _outputs(calls, 2)
    finally:
        cpu._pool_enable(True)
    for name in calls:
        assert torch.equal(openmp[name], two[name]), name


def test_a_call_completes_while_the_workers_are_held(cpu, quant, two_threads) -> None:
    calls = _kernel_calls(cpu, quant)
    expected = _outputs(calls, 1)
    cpu._pool_hold_workers(True)
    try:
        before = cpu._pool_stats()
        for _ in range(3):
            got = {name: call() for name, call in calls.items()}
        after = cpu._pool_stats()
    finally:
        cpu._pool_hold_workers(False)
    assert after["workers"] == 1
    assert after["jobs"] >= before["jobs"] + 3 * len(calls)
    assert after["worker_chunks"] == before["worker_chunks"]  # the caller ran every chunk
    assert after["caller_chunks"] > before["caller_chunks"]
    for name in calls:
        assert torch.equal(got[name], expected[name]), name


def test_the_workers_take_chunks_when_not_held(cpu, quant, two_threads) -> None:
    x, w = torch.randn(4, 1536).bfloat16(), torch.randn(4096, 1536).bfloat16()
    before = cpu._pool_stats()["worker_chunks"]
    for _ in range(200):  # the worker sleeps between calls only after its spin: it joins in
        cpu.small_linear(x, w)
    assert cpu._pool_stats()["worker_chunks"] > before


def test_back_to_back_calls_from_two_python_threads_end(cpu, quant, two_threads) -> None:
    calls = _kernel_calls(cpu, quant)
    expected = _outputs(calls, 1)
    wrong: list[str] = []

    def hammer() -> None:
        for _ in range(60):
            for name, call in calls.items():
                if not torch.equal(call(), expected[name]):
                    wrong.append(name)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a kernel call did not return"
    assert wrong == []


def test_an_idle_pool_burns_no_cpu(cpu, quant, two_threads) -> None:
    x, w = torch.randn(1, 576).bfloat16(), torch.randn(1000, 576).bfloat16()
    for _ in range(100):
        cpu.small_linear(x, w)
    assert cpu._pool_stats()["workers"] == 1
    time.sleep(0.05)  # past the workers' spin
    start = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(0.5)
    end = resource.getrusage(resource.RUSAGE_SELF)
    used = (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)
    assert used < 0.05, f"{used:.3f} s of CPU in 0.5 s idle"


def test_one_thread_runs_inline_and_the_pool_resizes(cpu, quant) -> None:
    x, w = torch.randn(1, 576).bfloat16(), torch.randn(1000, 576).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        jobs = cpu._pool_stats()["jobs"]
        cpu.small_linear(x, w)
        assert cpu._pool_stats()["jobs"] == jobs  # inline: no job
        torch.set_num_threads(2)
        cpu.small_linear(x, w)
        stats = cpu._pool_stats()
        assert stats["jobs"] == jobs + 1 and stats["workers"] == 1
    finally:
        torch.set_num_threads(before)


def test_the_quant_kernels_share_the_cpu_kernels_pool(cpu, quant, two_threads) -> None:
    blocks = _blocks(256, 64, T.Q8_0)
    jobs = cpu._pool_stats()["jobs"]
    quant.quant_linear(torch.randn(1, 64), blocks, int(T.Q8_0))
    assert cpu._pool_stats()["jobs"] == jobs + 1
    assert quant._pool_stats() == cpu._pool_stats()


def test_the_build_key_covers_the_headers_a_source_includes(tmp_path: Path) -> None:
    source, header = tmp_path / "k.cpp", tmp_path / "h.h"
    source.write_text('#include <vector>\n#include "h.h"\nint f() { return g(); }\n')
    header.write_text("inline int g() { return 1; }\n")
    files = kernels.build_files(source)
    assert list(files) == ["k.cpp", "h.h"]
    key = kernels._key_bytes(files)
    header.write_text("inline int g() { return 2; }\n")
    assert kernels._key_bytes(kernels.build_files(source)) != key
    alone = tmp_path / "alone.cpp"
    alone.write_text("int f() { return 1; }\n")
    assert kernels._key_bytes(kernels.build_files(alone)) == alone.read_bytes()
    assert "parallel.h" in kernels.build_files(kernels.SOURCE)
    assert "parallel.h" in kernels.build_files(kernels.QUANT_SOURCE)


POOL_PROBE = """
import torch
from sluice.model import kernels
torch.set_num_threads(2)
ops = kernels.cpu_ops()
jobs = ops._pool_stats()["jobs"]
ops.silu_and_mul(torch.randn(64, 2 * 1536))
print("POOL JOBS", ops._pool_stats()["jobs"] - jobs)
"""


@pytest.mark.parametrize(("env", "expect_jobs"), [("0", False), ("1", True)])
def test_the_pool_is_off_unless_sluice_kernel_pool_asks(env: str, expect_jobs: bool) -> None:
    """OpenMP splits the kernels' work by default; SLUICE_KERNEL_POOL=1 hands it to the pool."""
    out = subprocess.run(
        [sys.executable, "-c", POOL_PROBE], capture_output=True, text=True, timeout=300,
        env={**os.environ, "SLUICE_KERNEL_POOL": env},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("POOL JOBS")]
    assert (int(line.split()[-1]) > 0) == expect_jobs, out.stdout
