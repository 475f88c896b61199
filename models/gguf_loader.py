"""Our GGUF loader: an ArchConfig from the header, and dequantized float32 weights in Hugging
Face layout, named as in the file (the model's tensor map places them). Tensor data is a
``np.memmap`` dequantized by ``gguf.quants.dequantize`` (every type it implements: F32, F16,
BF16, Q4_0..Q8_0, the K-quants, the IQ types, ...).

What is particular to an architecture (its header keys, what llama.cpp hard-codes for it, what
its converter changed in the tensors) the model class declares (models/base.py); the registry
finds the class from ``general.architecture``.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from models.config import ArchConfig
from models.gguf_header import GGUFFile, GGUFTensorInfo, read_gguf, read_gguf_metadata
from models.rope import STRETCHING_TYPES, RopeScaling, rope_scaling_from

if TYPE_CHECKING:
    from models.base import CausalLM

__all__ = ["GGUFFile", "GGUFTensorInfo", "GGUFArchKeys", "read_gguf", "read_gguf_metadata", "gguf_model_config",
           "iter_gguf_weights", "unpermute_rotary_rows"]


@dataclass(frozen=True)
class GGUFArchKeys:
    """One file's ``<general.architecture>.*`` header keys, named without that prefix."""
    path: str
    arch: str
    metadata: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str, default: Any = None) -> Any:
        """The key's value (``default`` when absent); raises naming the key when both are None."""
        value = self.get(key, default)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return value


def gguf_model_config(gguf: GGUFFile) -> ArchConfig:
    """The ArchConfig of a GGUF file, from its header and the names of its tensors."""
    arch = gguf.metadata.get("general.architecture")
    architecture = _hf_architecture(arch)
    keys = GGUFArchKeys(gguf.path, arch, gguf.metadata)
    model_class = _model_class(architecture)
    fields = _generic_fields(gguf, keys, architecture, model_class.gguf_eog_tokens)
    return ArchConfig(**{**fields, **model_class.gguf_fields(keys, fields)})


# The registry is imported when called: it imports the model classes, which import this module.
# config.json keys an override may set on a GGUF file's config -> how (the header is its config)
_GGUF_OVERRIDES = {
    "max_position_embeddings": lambda c, v: _max_positions_override(c, int(v)),
    "rope_theta": lambda c, v: {"rope_theta": float(v)},
    "rms_norm_eps": lambda c, v: {"rms_norm_eps": float(v)},
    "sliding_window": lambda c, v: {"sliding_window": None if v is None else int(v)},
    "rope_scaling": lambda c, v: _rope_override(c, v),
    "bos_token_id": lambda c, v: {"bos_token_id": v},
    "eos_token_id": lambda c, v: {"eos_token_ids": tuple(v) if isinstance(v, list) else (v,)},
    "query_pre_attn_scalar": lambda c, v: {"query_pre_attn_scalar": v},
    "attn_logit_softcapping": lambda c, v: {"attn_logit_softcapping": v},
    "final_logit_softcapping": lambda c, v: {"final_logit_softcapping": v},
}


def _max_positions_override(config: ArchConfig, max_positions: int) -> dict[str, Any]:
    """A config.json max_position_embeddings over a GGUF file's context (stretched by its rope
    scaling, as config.json's would be)."""
    rope = config.rope_scaling
    if rope.rope_type in STRETCHING_TYPES:
        rope = dataclasses.replace(rope, original_max_position_embeddings=max_positions)
    return {"max_model_len": rope.stretched_len(max_positions), "rope_scaling": rope}


def _rope_override(config: ArchConfig, scaling: Any) -> dict[str, Any]:
    """A config.json rope_scaling over a GGUF file's: its context stretched as a config.json's
    max_position_embeddings would be."""
    original = config.rope_scaling.original_max_position_embeddings or config.max_model_len
    rope = rope_scaling_from(scaling, original)
    return {"rope_scaling": rope, "max_model_len": rope.stretched_len(original)}


def with_gguf_overrides(config: ArchConfig, overrides: dict[str, Any]) -> ArchConfig:
    """vLLM's --hf-overrides on a GGUF file's config: the config.json keys its header gives."""
    unknown = sorted(set(overrides) - set(_GGUF_OVERRIDES))
    if unknown:
        raise ValueError(f"--hf-overrides: {', '.join(unknown)} cannot be set on a GGUF file's config; "
                         f"these can: {', '.join(_GGUF_OVERRIDES)}")
    for key, value in overrides.items():       # each over the others before it (the context and the rope meet)
        try:
            config = dataclasses.replace(config, **_GGUF_OVERRIDES[key](config, value))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--hf-overrides: {key} {value!r}: {exc}") from None
    return config


def _hf_architecture(gguf_architecture: str | None) -> str:
    from models.registry import hf_architecture_of_gguf
    return hf_architecture_of_gguf(gguf_architecture)


def _model_class(architecture: str) -> type[CausalLM]:
    from models.registry import get_model_class
    return get_model_class(architecture)


def _generic_fields(gguf: GGUFFile, keys: GGUFArchKeys, architecture: str,
                    eog_tokens: tuple[str, ...]) -> dict[str, Any]:
    """The ArchConfig fields every architecture's header gives the same way."""
    meta = gguf.metadata
    hidden, num_heads = keys.require("embedding_length"), keys.require("attention.head_count")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    tokens = meta.get("tokenizer.ggml.tokens") or ()
    eog = tuple(i for i, t in enumerate(tokens) if t in eog_tokens and i != eos)
    rope_scaling = _rope_scaling(gguf, keys)
    head_size = keys.require("attention.key_length", hidden // num_heads)
    rotary = keys.get("rope.dimension_count", head_size)
    return dict(
        architecture=architecture,
        vocab_size=_vocab_size(gguf, keys),
        hidden_size=hidden,
        intermediate_size=keys.require("feed_forward_length"),
        num_layers=keys.require("block_count"),
        num_heads=num_heads,
        num_kv_heads=keys.require("attention.head_count_kv", num_heads),
        head_size=head_size,
        max_model_len=rope_scaling.stretched_len(keys.require("context_length")),
        rope_theta=float(keys.require("rope.freq_base", 10000.0)),
        rms_norm_eps=float(keys.require("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(() if eos is None else (eos,)) + eog,
        qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
        o_bias="blk.0.attn_output.bias" in gguf.tensors,
        rope_scaling=rope_scaling,
        rotary_dim=None if rotary == head_size else rotary,
    )


def _vocab_size(gguf: GGUFFile, keys: GGUFArchKeys) -> int:
    """The tokenizer's token count (else the vocab_size key), checked against token_embd."""
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens is not None else keys.require("vocab_size")
    embd = gguf.tensors.get("token_embd.weight")
    if embd is not None and embd.shape[0] != vocab_size:
        raise ValueError(f"{gguf.path}: token_embd has {embd.shape[0]} rows but the vocabulary has {vocab_size} tokens")
    return vocab_size


# tensors that are rope tables' inputs, not weights: read into the config, never loaded
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _rope_scaling(gguf: GGUFFile, keys: GGUFArchKeys) -> RopeScaling:
    """The header's rope scaling as llama.cpp's converter writes it: ``rope.scaling.type``
    none, linear or yarn; Llama 3.1's scaling as a ``rope_freqs`` tensor (a divisor per
    frequency); Phi-3's longrope as ``rope_factors_short``/``rope_factors_long`` tensors."""
    data = np.memmap(gguf.path, mode="r")
    vectors = {name: tuple(dequantize_tensor(data, gguf.tensors[name]).reshape(-1).tolist())
               for name in ROPE_TENSORS if name in gguf.tensors}
    kind = keys.get("rope.scaling.type", "none")
    context = keys.require("context_length")
    original = keys.get("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in vectors:
        if "rope_factors_short.weight" not in vectors:
            raise ValueError(f"{gguf.path}: rope_factors_long without rope_factors_short")
        return rope_scaling_from({"rope_type": "longrope", "short_factor": vectors["rope_factors_short.weight"],
                                  "long_factor": vectors["rope_factors_long.weight"],
                                  "attention_factor": keys.get("rope.scaling.attn_factor")},
                                 context, original or context)
    if kind in ("none", "linear"):
        scaling = (rope_scaling_from({"rope_type": "linear", "factor": keys.require("rope.scaling.factor")}, context)
                   if kind == "linear" else RopeScaling())
    elif kind == "yarn":
        if float(keys.get("rope.scaling.yarn_log_multiplier", 0.0)):
            raise ValueError(f"{gguf.path}: YaRN with a yarn_log_multiplier (DeepSeek's) is not supported")
        scaling = rope_scaling_from({"rope_type": "yarn", "factor": keys.require("rope.scaling.factor"),
                                     "beta_fast": keys.get("rope.scaling.yarn_beta_fast"),
                                     "beta_slow": keys.get("rope.scaling.yarn_beta_slow")},
                                    context, original or context)
    else:
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, yarn")
    if "rope_freqs.weight" in vectors:
        scaling = dataclasses.replace(scaling, freq_factors=vectors["rope_freqs.weight"])
    return scaling


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


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block, as a float32 column."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes a block -> its 32 4-bit codes, the low nibbles first (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float().mul_(_scale(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 2:]).to(torch.int8).sub_(8).float().mul_(_scale(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:]).float().mul_(_scale(b, 0)).add_(_scale(b, 2))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    high = (b[:, 2:6].contiguous().view(torch.int32) >> torch.arange(32, dtype=torch.int32)) & 1   # bit i: code i
    return (_nibbles(b[:, 6:]).int() | (high << 4)).sub_(16).float().mul_(_scale(b, 0))


# The simple block formats the checkpoints we ship use, dequantized with torch's (threaded)
# elementwise ops: the same float32 arithmetic as gguf.quants (d * q, then + m, each rounded), so
# the same values, several times faster; the other types go through gguf.quants.
_TORCH_DEQUANT = {GGMLQuantizationType.Q8_0: _q8_0, GGMLQuantizationType.Q4_0: _q4_0,
                  GGMLQuantizationType.Q4_1: _q4_1, GGMLQuantizationType.Q5_0: _q5_0}


def dequantize_tensor(data: np.memmap, info: GGUFTensorInfo) -> torch.Tensor:
    """One tensor as float32 in numpy/torch order ((out, in) for a weight)."""
    fast = _TORCH_DEQUANT.get(info.ggml_type)
    if fast is not None:
        raw = raw_tensor_data(data, info)
        with warnings.catch_warnings():          # the map is read-only; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(raw).reshape(-1, GGML_QUANT_SIZES[info.ggml_type][1])
        return fast(blocks).reshape(info.shape)
    try:
        array = dequantize(raw_tensor_data(data, info), info.ggml_type)
    except NotImplementedError as exc:
        raise ValueError(f"tensor {info.name}: the gguf package cannot dequantize {info.ggml_type.name} ({exc})") from exc
    if not array.flags.writeable:  # F32 comes back as a view of the read-only map
        array = array.copy()
    return torch.from_numpy(array.astype(np.float32, copy=False)).reshape(info.shape)


def iter_gguf_weights(gguf: GGUFFile, config: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (GGUF tensor name, float32 tensor in HF layout, (out, in) for weights)."""
    model_class = _model_class(config.architecture)
    fixups = model_class.gguf_row_fixups(config) + model_class.gguf_value_fixups(config)
    data = np.memmap(gguf.path, mode="r")
    for info in gguf.tensors.values():
        if info.name in ROPE_TENSORS:
            continue
        tensor = dequantize_tensor(data, info)
        for suffix, fix in fixups:
            if info.name.endswith(suffix):
                tensor = fix(tensor)
        yield info.name, tensor
