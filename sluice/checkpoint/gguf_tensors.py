"""A GGUF file's tensor directory (name, shape, ggml type, raw bytes), read without its metadata.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array, which for a
tokenizer's vocabulary and merges costs seconds per open (3.6 s for SmolLM2-135M here); loading
the block weights needs only the tensor directory. Here the metadata is skipped by its byte
lengths (each string array element is still stepped over, in plain Python), and only
`general.alignment` is read, since it places the data section.

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, metadata count u64;
each metadata entry a string key, a type u32 and a value; then per tensor a string name, the
number of dims u32, the dims u64 (the fastest first), the ggml type u32 and the data offset u64
(from the start of the data section, which begins at the next multiple of the alignment).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# metadata value type -> its size in bytes (the fixed-size scalar types)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT_FORMATS = {0: "<B", 2: "<H", 4: "<I", 10: "<Q", 5: "<i", 11: "<q"}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    tensor_type: int  # a ggml type id (gguf.GGMLQuantizationType)
    data: np.ndarray  # its raw bytes, uint8, a view of the file's memory map


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.mem = memoryview(buf)  # type: ignore[arg-type]
        self.pos = 0

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.mem, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        self.pos += size
        return bytes(self.mem[self.pos - size : self.pos]).decode("utf-8")

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR_SIZES:
            self.pos += _SCALAR_SIZES[kind]
        elif kind == _STRING:
            size = self.unpack("<Q")  # moves pos past the length first
            self.pos += size
        elif kind == _ARRAY:
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            if item_kind in _SCALAR_SIZES:
                self.pos += count * _SCALAR_SIZES[item_kind]
            else:
                for _ in range(count):
                    self.skip_value(item_kind)
        else:
            raise ValueError(f"unknown GGUF metadata type {kind} at byte {self.pos}")


def read_gguf_tensors(path: str) -> list[GGUFTensor]:
    """The tensors of the GGUF at `path`, in file order; their bytes stay on disk until read."""
    from gguf import GGML_QUANT_SIZES

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    if bytes(cur.mem[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version, num_tensors, num_fields = cur.unpack("<I"), cur.unpack("<Q"), cur.unpack("<Q")
    if version < 2:
        raise ValueError(f"GGUF version {version} of {path} is not supported")
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(num_fields):
        key, kind = cur.string(), cur.unpack("<I")
        if key == "general.alignment" and kind in _UINT_FORMATS:
            alignment = cur.unpack(_UINT_FORMATS[kind])
        else:
            cur.skip_value(kind)
    infos = []
    for _ in range(num_tensors):
        name, num_dims = cur.string(), cur.unpack("<I")
        shape = tuple(cur.unpack("<Q") for _ in range(num_dims))
        infos.append((name, shape, cur.unpack("<I"), cur.unpack("<Q")))
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, tensor_type, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        size = int(np.prod(shape, dtype=np.int64)) // block_size * type_size
        data = buf[start + offset : start + offset + size]
        tensors.append(GGUFTensor(name, shape, tensor_type, data))
    return tensors
