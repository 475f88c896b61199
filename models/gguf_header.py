"""The GGUF header: metadata and the tensor directory, parsed without reading tensor data.

Parsed here with ``struct`` because ``gguf.GGUFReader`` builds a numpy view per array element
and takes ~1.6 s on the default model's 100k tokenizer strings (here: ~0.03 s). Torch-free, so
the frontend (tokenizer, chat template) can read a model's metadata cheaply.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType): scalars by struct format, plus STRING = 8 and ARRAY = 9.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]   # GGUF order, fastest first: a weight is [in, out]
    offset: int             # absolute byte offset of the data in the file

    @property
    def shape(self) -> tuple[int, ...]:  # numpy / torch order: a weight is (out, in)
        return tuple(reversed(self.dims))


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


class _HeaderParser:
    """Reads GGUF v2/v3 little-endian key/values and tensor infos from a byte buffer."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = _U64.unpack_from(self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return self.buf[start:start + n].decode("utf-8")

    def strings(self, count: int) -> list[str]:
        buf, pos, out, unpack = self.buf, self.pos, [], _U64.unpack_from
        for _ in range(count):  # the hot loop: ~100k tokenizer strings
            (n,) = unpack(buf, pos)
            out.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                return self.strings(count)
            if etype == _ARRAY:
                return [self.value(self.scalar("<I")) for _ in range(count)]
            if etype not in _SCALAR_FORMATS:
                raise ValueError(f"unknown GGUF array element type {etype} at byte {self.pos}")
            dtype = np.dtype(_SCALAR_FORMATS[etype])
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(_SCALAR_FORMATS[vtype])

    def header(self, with_tensors: bool) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
        if self.buf[:4] != GGUF_MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        self.pos = 4
        version = self.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (accepted: 2, 3, little-endian)")
        tensor_count, kv_count = self.scalar("<Q"), self.scalar("<Q")
        metadata = {}
        for _ in range(kv_count):
            key = self.string()
            metadata[key] = self.value(self.scalar("<I"))
        if not with_tensors:
            return metadata, {}
        infos = []
        for _ in range(tensor_count):
            name = self.string()
            dims = tuple(self.scalar("<Q") for _ in range(self.scalar("<I")))
            infos.append((name, dims, GGMLQuantizationType(self.scalar("<I")), self.scalar("<Q")))
        align = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        data_start = -(-self.pos // align) * align
        tensors = {name: GGUFTensorInfo(name, qtype, dims, data_start + off) for name, dims, qtype, off in infos}
        if len(tensors) != len(infos):
            raise ValueError("GGUF file has duplicate tensor names")
        return metadata, tensors


def _parse(path: str, with_tensors: bool) -> GGUFFile:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            metadata, tensors = _HeaderParser(buf).header(with_tensors)
        except (struct.error, IndexError) as e:
            raise ValueError(f"{path}: truncated or corrupt GGUF header ({e})") from e
    return GGUFFile(path, metadata, tensors)


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """All key/values of a GGUF file as plain Python values (str, int, float, bool, lists);
    reads only the header, no tensor data."""
    return _parse(path, with_tensors=False).metadata


def read_gguf(path: str) -> GGUFFile:
    """Metadata and the tensor directory (no tensor data yet)."""
    return _parse(path, with_tensors=True)
