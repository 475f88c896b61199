"""Cohere's Command R (``CohereForCausalLM``) and Command R7B (``Cohere2ForCausalLM``): one
LayerNorm (a weight, no bias) before a layer whose attention and SiLU-gated MLP both read it,
their outputs added to the stream together (a parallel block); an interleaved rotary (pairs 0 and
1, 2 and 3, ...), served by the kernels' half-split one through q's and k's rows reordered at load
(as GLM's, models/glm.py); logits multiplied by ``logit_scale``; a tied head. Command R7B's
layers mostly slide (``layer_types``, else every fourth global), its global ones without rotary
(NoPE)."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import TensorMap
from models.bert import LayerNorm
from models.config import FULL, SLIDING, ArchConfig
from models.gemma3 import LocalGlobalLM
from models.glm import interleaved_to_half_split
from models.layers import GatedMLP, SelfAttention


class CohereDecoderLayer(nn.Module):
    is_sliding = False          # every layer's rotary is the one table (NoPE layers turn nothing)

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.input_layernorm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype, bias=False)
        self.self_attn = SelfAttention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, backend, dtype, scale=c.attn_scale,
            sliding_window=c.layer_sliding_window(layer), qkv_bias=c.qkv_bias, o_bias=c.o_bias,
            use_rope=c.layer_uses_rope(layer))
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        return hidden + self.self_attn(normed, cos, sin, kv_cache, meta) + self.mlp(normed)


class CohereForCausalLM(LocalGlobalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_eps": 1e-5, "logit_scale": 0.0625, "tie_word_embeddings": True,
                                             "use_qk_norm": False}
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_tensor_map: ClassVar[TensorMap] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        "model.layers.{i}.input_layernorm.weight": ("layers.{i}.input_layernorm.weight", None),
        **{f"model.layers.{{i}}.self_attn.{s}_proj.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", s)
           for s in "qkv" for p in ("weight", "bias")},
        **{f"model.layers.{{i}}.self_attn.o_proj.{p}": (f"layers.{{i}}.self_attn.o_proj.{p}", None)
           for p in ("weight", "bias")},
        "model.layers.{i}.mlp.gate_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", "gate"),
        "model.layers.{i}.mlp.up_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", "up"),
        "model.layers.{i}.mlp.down_proj.weight": ("layers.{i}.mlp.down_proj.weight", None),
        "model.norm.weight": ("norm.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "rms_norm_eps": raw["layer_norm_eps"]}      # its LayerNorms' epsilon

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("use_qk_norm"):
            raise ValueError(f"{fields['architecture']} with use_qk_norm (Command R+'s per-head q/k LayerNorms) is "
                             "not supported")
        return {"logits_scaling": 1.0 / float(raw["logit_scale"])}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.rotary_dim is not None:
            raise ValueError(f"{type(self).__name__} with a partial rotary is not supported")
        self.build(config, dtype, lambda i: CohereDecoderLayer(config, i, attn_backend, dtype),
                   LayerNorm(config.hidden_size, config.rms_norm_eps, dtype, bias=False), local=False)
        self.logit_scale = 1.0 / config.logits_scaling

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                          "self_attn.k_proj.bias")):
            return interleaved_to_half_split(tensor, self.config.head_size, self.config.head_size)
        return tensor

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float() * self.logit_scale


class Cohere2ForCausalLM(CohereForCausalLM):
    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        n = fields["num_layers"]
        pattern = int(raw.get("sliding_window_pattern") or 4)
        types = tuple(raw.get("layer_types") or (FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)))
        return {**super().hf_fields(raw, fields), "sliding_window": raw.get("sliding_window"), "layer_types": types,
                "rope_layers": tuple(t == SLIDING for t in types)}     # the global layers have no rotary
