"""A GGUF file's metadata and tensor index, read without materializing its arrays.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array: for a
model with a 49k-token vocabulary and its merges that is ~150k objects and several seconds of
one core at every replica start, all for fields the loader never reads (the tokenizer comes
from the converted checkpoint). This reads the same file format (GGUF v2/v3, little-endian):
scalar and string fields are decoded, arrays are skipped over (their values kept only when
short), and each tensor's data is a view into one memory map, shaped as ``GGUFReader`` shapes
it (ggml's dims reversed; packed types as rows of bytes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = 0x46554747  # b"GGUF", little-endian
DEFAULT_ALIGNMENT = 32
MAX_KEPT_ARRAY = 64  # longer metadata arrays are skipped over, not decoded

# GGUF value types -> struct format (8 = string and 9 = array are handled apart).
_SCALARS = dict(enumerate("BbHhIif?")) | {10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_SKIPPED = object()  # what a skipped array reads as
_DENSE = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: the fastest-varying dimension first
    data: np.ndarray


@dataclass
class GGUFIndex:
    fields: dict[str, Any]  # skipped arrays are absent
    tensors: list[GGUFTensor]

    def field(self, key: str) -> Any:
        return self.fields.get(key)


class _Cursor:
    def __init__(self, buf: np.ndarray, path: Path) -> None:
        self.buf = buf
        self.view = memoryview(buf)  # type: ignore[arg-type]
        self.offs = 0
        self.path = path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.offs + size > len(self.buf):
            raise ValueError(f"{self.path.name}: GGUF file is truncated (at byte {self.offs})")
        (value,) = struct.unpack_from("<" + fmt, self.view, self.offs)
        self.offs += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.offs + n > len(self.buf):
            raise ValueError(f"{self.path.name}: GGUF file is truncated (at byte {self.offs})")
        raw = bytes(self.view[self.offs : self.offs + n])
        self.offs += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.take("Q")  # first: `offs += take()` would add to the offset before the take
        self.offs += n

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("I"), self.take("Q")
            if count <= MAX_KEPT_ARRAY:
                return [self.value(etype) for _ in range(count)]
            self.skip_array(etype, count)
            return _SKIPPED
        raise ValueError(f"{self.path.name}: unknown GGUF value type {vtype} at byte {self.offs}")

    def skip_array(self, etype: int, count: int) -> None:
        if etype in _SCALARS:
            self.offs += count * struct.calcsize("<" + _SCALARS[etype])
        elif etype == _STRING:
            for _ in range(count):
                self.skip_string()
        else:
            for _ in range(count):
                self.value(etype)


def read_gguf_index(path: Path) -> GGUFIndex:
    """The file's fields and tensors; the tensors' data stay in the file's memory map."""
    buf = np.memmap(path, mode="r")
    cur = _Cursor(buf, path)
    if len(buf) < 24 or cur.take("I") != MAGIC:
        raise ValueError(f"{path.name}: not a GGUF file (bad magic)")
    version = cur.take("I")
    if version not in (2, 3):
        raise ValueError(
            f"{path.name}: GGUF version {version} is not supported (2 or 3, little-endian)"
        )
    num_tensors, num_fields = cur.take("Q"), cur.take("Q")
    fields: dict[str, Any] = {}
    for _ in range(num_fields):
        key = cur.string()
        value = cur.value(cur.take("I"))
        if value is not _SKIPPED:
            fields[key] = value
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
        infos.append((name, dims, cur.take("I"), cur.take("Q")))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.offs // alignment) * alignment
    tensors = []
    for name, dims, raw_type, offset in infos:
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            msg = f"{path.name}: tensor {name!r} has unknown ggml type {raw_type}"
            raise ValueError(msg) from None
        block, type_size = GGML_QUANT_SIZES[kind]
        count = int(np.prod(dims)) if dims else 1
        nbytes = count * type_size // block
        begin = start + offset
        if begin + nbytes > len(buf):
            raise ValueError(f"{path.name}: tensor {name!r} runs past the end of the file")
        raw = buf[begin : begin + nbytes]
        shape = tuple(reversed(dims))
        if kind in _DENSE:
            data = raw.view(_DENSE[kind]).reshape(shape)
        else:  # packed rows of blocks (and BF16): [..., bytes per row], as GGUFReader has them
            data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        tensors.append(GGUFTensor(name, kind, dims, data))
    return GGUFIndex(fields, tensors)
