"""Our GGUF reader: metadata, tensor directory, a ModelConfig, and dequantized float32 weights
in Hugging Face layout, named as in the file (the model's tensor map places them).

The header (metadata and tensor directory) is parsed here with ``struct`` because
``gguf.GGUFReader`` builds a numpy view per array element and takes ~1.6 s on the default
model's 100k tokenizer strings; tensor data is a ``np.memmap`` and is dequantized by
``gguf.quants.dequantize``, as the reader would do.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from models.config import ModelConfig

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
# general.architecture -> Hugging Face architecture name
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

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


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{gguf.path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, num_heads = get("embedding_length"), get("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens is not None else get("vocab_size")
    embd = gguf.tensors.get("token_embd.weight")
    if embd is not None and embd.shape[0] != vocab_size:
        raise ValueError(f"{gguf.path}: token_embd has {embd.shape[0]} rows but the vocabulary has {vocab_size} tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", num_heads),
        head_size=get("attention.key_length", hidden // num_heads),
        max_model_len=get("context_length"),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def _tensor_data(data: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """The raw (still quantized) data as gguf.quants.dequantize expects it."""
    shape = info.shape
    n_elements = int(np.prod(shape))
    if info.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        dtype = np.float32 if info.ggml_type == GGMLQuantizationType.F32 else np.float16
        return np.frombuffer(data, dtype, n_elements, info.offset).reshape(shape)
    block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
    if shape[-1] % block_size:
        raise ValueError(f"tensor {info.name}: row length {shape[-1]} is not a multiple of {info.ggml_type.name} "
                         f"block size {block_size}")
    n_bytes = n_elements // block_size * type_size
    return np.frombuffer(data, np.uint8, n_bytes, info.offset).reshape(*shape[:-1], shape[-1] // block_size * type_size)


def unpermute_rotary_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf ``permute`` of attn_q/attn_k rows: within each head
    it interleaves the two rotary halves (x0 y0 x1 y1 ...); HF's half-split rotary wants
    (x0 x1 ... y0 y1 ...). weight (n_head * D, in) -> same shape."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _gguf_fixups(config: ModelConfig) -> dict[str, int]:
    """Tensor-name suffix -> number of heads whose rows llama.cpp permuted."""
    if config.architecture == "LlamaForCausalLM":
        return {".attn_q.weight": config.num_heads, ".attn_k.weight": config.num_kv_heads}
    return {}


def iter_gguf_weights(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (GGUF tensor name, float32 tensor in HF layout, (out, in) for weights)."""
    fixups = _gguf_fixups(config)
    data = np.memmap(gguf.path, mode="r")
    for info in gguf.tensors.values():
        array = dequantize(_tensor_data(data, info), info.ggml_type)
        if not array.flags.writeable:  # F32 comes back as a view of the read-only map
            array = array.copy()
        tensor = torch.from_numpy(array)
        for suffix, n_head in fixups.items():
            if info.name.endswith(suffix):
                tensor = unpermute_rotary_rows(tensor, n_head)
        yield info.name, tensor
