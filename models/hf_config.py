"""A Hugging Face ``config.json`` (plus ``generation_config.json``) -> ArchConfig.

Reads both transformers 4.x keys (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``,
``sliding_window_pattern``) and 5.x keys (``rope_parameters``, per layer type for Gemma 3).
"""
from __future__ import annotations

import json
import os
from typing import Any

from models.config import FULL, SLIDING, ArchConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM")
_GEMMA3 = "Gemma3ForCausalLM"
# transformers' defaults for keys a config.json may leave out (the rest are required)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": {"head_dim": 128},
    "MistralForCausalLM": {"sliding_window": 4096},
    _GEMMA3: {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
              "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
}


def read_hf_config(checkpoint_dir: str) -> ArchConfig:
    """The ArchConfig of the checkpoint in ``checkpoint_dir`` (config.json required)."""
    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        raw = json.load(f)
    generation: dict[str, Any] = {}
    gen_path = os.path.join(checkpoint_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            generation = json.load(f)
    try:
        return hf_model_config(raw, generation)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{checkpoint_dir}/config.json is missing or has a malformed field: {exc!r}") from exc


def hf_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ArchConfig:
    arch = _architecture(raw)
    raw = {**_DEFAULTS.get(arch, {}), **raw}   # a key present as null stays null (Mistral: no window)
    hidden, num_heads = raw["hidden_size"], raw["num_attention_heads"]
    num_layers = raw["num_hidden_layers"]
    if raw.get("mlp_bias"):
        raise ValueError(f"{arch} with mlp_bias=true is not supported")
    theta, factor = _rope(raw, FULL)
    attention_bias = bool(raw.get("attention_bias", False))
    sliding_window, layer_types = _sliding(raw, arch, num_layers)
    eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
    return ArchConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_size=raw.get("head_dim") or hidden // num_heads,
        max_model_len=raw["max_position_embeddings"],
        rope_theta=theta,
        rms_norm_eps=float(raw["rms_norm_eps"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",   # Qwen2 always has q/k/v biases
        o_bias=attention_bias,
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
        sliding_window=sliding_window,
        layer_types=layer_types,
        rope_local_theta=_rope(raw, SLIDING)[0] if arch == _GEMMA3 else None,
        rope_scaling_factor=factor,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if arch == _GEMMA3 else None,
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"config.json architectures {archs} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _rope(raw: dict[str, Any], layer_type: str) -> tuple[float, float]:
    """(theta, linear scaling factor) of the layers of ``layer_type``."""
    params = raw.get("rope_parameters")
    if params is not None and layer_type in params:          # 5.x, per layer type (Gemma 3)
        params = params[layer_type]
    if params is None:                                       # 4.x
        if layer_type == SLIDING:
            return float(raw.get("rope_local_base_freq", 10_000.0)), 1.0
        params = {"rope_theta": raw.get("rope_theta", 10_000.0), **(raw.get("rope_scaling") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"rope type {kind!r} is not supported; supported: 'default', 'linear'")
    factor = float(params.get("factor", 1.0)) if kind == "linear" else 1.0
    return float(params.get("rope_theta", raw.get("rope_theta", 10_000.0))), factor


def _sliding(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) with transformers' rules for each architecture."""
    window = raw.get("sliding_window")
    if arch == "MistralForCausalLM":      # one window for every layer, layer_types ignored
        return window, None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not raw.get("use_sliding_window", False):
            return None, None
        types = raw.get("layer_types") or [SLIDING if i >= raw.get("max_window_layers", 28) else FULL
                                           for i in range(num_layers)]
        return window, tuple(types)
    if arch == _GEMMA3:
        if raw.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention=true (an encoder) is not supported")
        pattern = raw.get("sliding_window_pattern", 6)
        types = raw.get("layer_types") or [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
        return window, tuple(types)
    return None, None
