"""The llama-server build's CMake options for canned CPUs (no build runs here)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.benchmarks import load_benchmark

# /proc/cpuinfo flags lines, trimmed to what matters
SAPPHIRE_RAPIDS = (
    "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 bmi2 fma f16c avx_vnni avx512f avx512dq "
    "avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 "
    "amx_tile amx_int8"
)
ZEN4 = (
    "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 bmi2 fma f16c avx512f avx512dq avx512cd avx512bw "
    "avx512vl avx512vbmi avx512_vnni avx512_bf16"
)
ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 bmi2 fma f16c"


@pytest.fixture(scope="module")
def llama_server() -> ModuleType:
    return load_benchmark("llama_server")


def _on(options: dict[str, str]) -> set[str]:
    return {k for k, v in options.items() if v == "ON"}


def _options(llama_server: ModuleType, flags: str) -> dict[str, str]:
    cpuinfo = f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
    return llama_server.isa_options(llama_server.cpu_flags(cpuinfo), "x86_64")


def test_an_amx_cpu_gets_avx512_vnni_and_bf16_but_no_amx(llama_server: ModuleType) -> None:
    options = _options(llama_server, SAPPHIRE_RAPIDS)
    assert options["GGML_NATIVE"] == "OFF"
    assert _on(options) == {
        "GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C",
        "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
    }  # fmt: skip
    assert all(options[k] == "OFF" for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))


def test_zen4_gets_avx512_without_avx_vnni(llama_server: ModuleType) -> None:
    on = _on(_options(llama_server, ZEN4))
    assert {"GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX2"} <= on
    assert "GGML_AVX_VNNI" not in on and not any("AMX" in k for k in on)


def test_zen3_gets_avx2_and_no_avx512(llama_server: ModuleType) -> None:
    options = _options(llama_server, ZEN3)
    assert _on(options) == {
        "GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C"
    }  # fmt: skip
    assert options["GGML_AVX512"] == options["GGML_AVX512_BF16"] == "OFF"


def test_avx512_extensions_need_the_whole_avx512_base(llama_server: ModuleType) -> None:
    # GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw: a CPU lacking one gets none of them
    on = _on(_options(llama_server, ZEN4.replace(" avx512vl", "")))
    assert not any(k.startswith("GGML_AVX512") for k in on) and "GGML_AVX2" in on


def test_other_machines_and_unknown_cpus_build_native(llama_server: ModuleType) -> None:
    arm = llama_server.isa_options({"fp", "asimd"}, "aarch64")
    assert arm == {"GGML_NATIVE": "ON"}
    assert llama_server.isa_options(None, "x86_64") == {"GGML_NATIVE": "ON"}
    assert llama_server.cpu_flags("processor\t: 0\n") is None


def test_the_build_folder_is_named_after_the_options(llama_server: ModuleType) -> None:
    amx, zen3 = _options(llama_server, SAPPHIRE_RAPIDS), _options(llama_server, ZEN3)
    name = llama_server.build_name
    assert name(amx) == name(dict(reversed(amx.items()))) and name(amx).startswith("build-")
    assert name(amx) != name(zen3) != name({"GGML_NATIVE": "ON"})
    assert "GGML_NATIVE" not in llama_server.CMAKE_OPTIONS  # set by the instruction sets only
