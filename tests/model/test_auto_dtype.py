"""`--dtype auto`: bfloat16 on CUDA and on CPUs with native bfloat16, float32 elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.model.runner import auto_dtype
from sluice.utils.system import cpu_flags

CPU = torch.device("cpu")
# flag sets as seen on the machines this project runs on (trimmed)
XEON_AMX = frozenset("avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8".split())
ZEN4 = frozenset("avx2 avx512f avx512_bf16 avx512_vnni".split())
ZEN3 = frozenset("avx2 fma f16c".split())
AVX512_NO_BF16 = frozenset("avx2 avx512f avx512bw avx512_vnni".split())


@pytest.mark.parametrize(
    ("flags", "dtype", "why"),
    [
        (XEON_AMX, torch.bfloat16, "amx_bf16"),
        (ZEN4, torch.bfloat16, "avx512_bf16"),
        (ZEN3, torch.float32, "no native bfloat16"),
        (AVX512_NO_BF16, torch.float32, "no native bfloat16"),
        (frozenset(), torch.float32, "no native bfloat16"),
    ],
)
def test_auto_dtype_on_cpu_follows_native_bf16(flags, dtype, why) -> None:
    chosen, reason = auto_dtype(CPU, flags)
    assert chosen == dtype and why in reason


def test_auto_dtype_on_cuda_is_bfloat16_whatever_the_cpu() -> None:
    assert auto_dtype(torch.device("cuda"), ZEN3)[0] == torch.bfloat16


def test_cpu_flags_read_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
