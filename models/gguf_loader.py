"""Our GGUF loader: an ArchConfig from the header, and dequantized float32 weights in Hugging
Face layout, named as in the file (the model's tensor map places them). Tensor data is a
``np.memmap`` dequantized by ``gguf.quants.dequantize`` (every type it implements: F32, F16,
BF16, Q4_0..Q8_0, the K-quants, the IQ types, ...).

llama.cpp's converter changes some tensors on the way in, undone here per architecture:
llama permutes attn_q/attn_k rows for its interleaved rotary; Gemma stores norms as 1 + weight.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from models.config import FULL, SLIDING, ArchConfig
from models.gguf_header import GGUFFile, GGUFTensorInfo, read_gguf, read_gguf_metadata

__all__ = ["GGUFFile", "GGUFTensorInfo", "read_gguf", "read_gguf_metadata", "gguf_model_config",
           "iter_gguf_weights", "unpermute_rotary_rows"]

# general.architecture -> Hugging Face architecture name
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM"}
GEMMA3_SLIDING_PATTERN = 6        # llama.cpp: every 6th layer is global
GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
_EOG_TOKENS = ("<end_of_turn>",)  # end-of-generation tokens llama.cpp recognises beside eos


def gguf_model_config(gguf: GGUFFile) -> ArchConfig:
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
    eog = [i for i, t in enumerate(tokens or ()) if t in _EOG_TOKENS and i != eos] if arch == "gemma3" else []
    head_size = get("attention.key_length", hidden // num_heads)
    fields = dict(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", num_heads),
        head_size=head_size,
        max_model_len=get("context_length"),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(() if eos is None else (eos,)) + tuple(eog),
        qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
        o_bias="blk.0.attn_output.bias" in gguf.tensors,
        rope_scaling_factor=_linear_rope_factor(meta, arch),
    )
    if arch == "gemma3":
        fields.update(_gemma3_fields(meta, fields))
    return ArchConfig(**fields)


def _linear_rope_factor(meta: dict[str, Any], arch: str) -> float:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear")
    return float(meta.get(f"{arch}.rope.scaling.factor", 1.0)) if kind == "linear" else 1.0


def _gemma3_fields(meta: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp hard-codes for gemma3 (or reads from newer keys when present)."""
    n = fields["num_layers"]
    pattern = meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):   # per layer: True = sliding
        layer_types = tuple(SLIDING if s else FULL for s in pattern)
    else:
        layer_types = tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n))
    # llama.cpp: 27B (62 layers) scales by hidden / heads, every other size by head_size
    scalar = fields["hidden_size"] // fields["num_heads"] if n == 62 else fields["head_size"]
    return dict(
        hidden_act="gelu_pytorch_tanh",
        sliding_window=meta["gemma3.attention.sliding_window"],
        layer_types=layer_types,
        rope_local_theta=float(meta.get("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)),
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=meta.get("gemma3.attn_logit_softcapping"),
        final_logit_softcapping=meta.get("gemma3.final_logit_softcapping"),
    )


def raw_tensor_data(data: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
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


Fixup = Callable[[torch.Tensor], torch.Tensor]


def _gguf_fixups(config: ArchConfig) -> list[tuple[str, Fixup]]:
    """(tensor-name suffix, what undoes llama.cpp's conversion of it). Qwen2/Qwen3/Gemma use
    NeoX rotary in llama.cpp, so their q/k rows are not permuted."""
    if config.architecture == "LlamaForCausalLM":
        return [(".attn_q.weight", lambda w: unpermute_rotary_rows(w, config.num_heads)),
                (".attn_k.weight", lambda w: unpermute_rotary_rows(w, config.num_kv_heads))]
    if config.architecture == "Gemma3ForCausalLM":   # every *norm.weight holds 1 + weight
        return [("norm.weight", lambda w: w - 1.0)]
    return []


def dequantize_tensor(data: np.memmap, info: GGUFTensorInfo) -> torch.Tensor:
    """One tensor as float32 in numpy/torch order ((out, in) for a weight)."""
    try:
        array = dequantize(raw_tensor_data(data, info), info.ggml_type)
    except NotImplementedError as exc:
        raise ValueError(f"tensor {info.name}: the gguf package cannot dequantize {info.ggml_type.name} ({exc})") from exc
    if not array.flags.writeable:  # F32 comes back as a view of the read-only map
        array = array.copy()
    return torch.from_numpy(array.astype(np.float32, copy=False)).reshape(info.shape)


def iter_gguf_weights(gguf: GGUFFile, config: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (GGUF tensor name, float32 tensor in HF layout, (out, in) for weights)."""
    fixups = _gguf_fixups(config)
    data = np.memmap(gguf.path, mode="r")
    for info in gguf.tensors.values():
        tensor = dequantize_tensor(data, info)
        for suffix, fix in fixups:
            if info.name.endswith(suffix):
                tensor = fix(tensor)
        yield info.name, tensor
