"""Our GGUF loader: a ModelConfig from the header, and dequantized float32 weights in Hugging
Face layout, named as in the file (the model's tensor map places them). Tensor data is a
``np.memmap`` dequantized by ``gguf.quants.dequantize``."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from models.config import ModelConfig
from models.gguf_header import GGUFFile, GGUFTensorInfo, read_gguf, read_gguf_metadata

__all__ = ["GGUFFile", "GGUFTensorInfo", "read_gguf", "read_gguf_metadata", "gguf_model_config",
           "iter_gguf_weights", "unpermute_rotary_rows"]

# general.architecture -> Hugging Face architecture name
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


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
