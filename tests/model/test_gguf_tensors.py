"""`read_gguf_tensors` against gguf's own GGUFReader: the same names, shapes, types and bytes,
past metadata of every kind (string arrays included) and with a non-default alignment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sluice.checkpoint.gguf_tensors import read_gguf_tensors

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402


def _assert_same_as_ggufs_reader(path: str) -> None:
    mine = read_gguf_tensors(path)
    theirs = gguf.GGUFReader(path).tensors
    assert [t.name for t in mine] == [t.name for t in theirs]
    for a, b in zip(mine, theirs, strict=True):
        assert a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.tensor_type == int(b.tensor_type), a.name
        assert np.array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(-1)), a.name


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_written_gguf_reads_back_its_tensors(tmp_path: Path, alignment: int | None) -> None:
    path = str(tmp_path / "t.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "你好"] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5] * 200)
    writer.add_uint32("llama.block_count", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((3, 5)).astype(np.float32)
    writer.add_tensor("dense.weight", dense)
    blocks = quantize(
        rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_shape=blocks.shape,
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in read_gguf_tensors(path)}
    assert tensors["dense.weight"].shape == (5, 3)  # the fastest dimension first
    assert np.array_equal(tensors["dense.weight"].data.view(np.float32).reshape(3, 5), dense)
    q = tensors["blk.0.attn_q.weight"]
    assert q.shape == (64, 4) and q.tensor_type == int(gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(q.data.reshape(blocks.shape), blocks)
    _assert_same_as_ggufs_reader(path)


def test_the_default_model_reads_as_ggufs_reader_reads_it(smollm2_gguf: str) -> None:
    _assert_same_as_ggufs_reader(smollm2_gguf)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_tensors(str(path))
