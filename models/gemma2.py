"""Gemma 2: Gemma 3's layers without the q/k norms, every other layer sliding (the even ones),
one rotary base for all, and its scores capped in every attention (``attn_logit_softcapping``:
C * tanh(s / C), taken by the CPU backend's torch path) besides its final logits. llama.cpp's
"gemma2" GGUF keeps both caps in its header and hard-codes the rest. Gemma (the first
generation): the same embeddings, norms and head around simpler layers."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.config import FULL, SLIDING, ArchConfig
from models.gemma3 import Gemma3ForCausalLM
from models.gguf_loader import GGUFArchKeys
from models.layers import GatedMLP, GemmaRMSNorm, SelfAttention


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {       # transformers' Gemma2Config defaults
        "vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True}
    gguf_architectures: ClassVar[tuple[str, ...]] = ("gemma2",)
    qk_norm: ClassVar[bool] = False

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        n = fields["num_layers"]
        types = raw.get("layer_types") or _layer_types(n)
        return dict(sliding_window=raw.get("sliding_window"), layer_types=tuple(types), rope_local_theta=None,
                    query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
                    hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")

    @classmethod
    def gguf_fields(cls, keys: GGUFArchKeys, fields: dict[str, Any]) -> dict[str, Any]:
        """What llama.cpp hard-codes for gemma2: the even layers slide; the 27B (46 layers) scales
        queries by hidden / heads, every other size by head_size."""
        n = fields["num_layers"]
        scalar = fields["hidden_size"] // fields["num_heads"] if n == 46 else fields["head_size"]
        return dict(hidden_act="gelu_pytorch_tanh", sliding_window=keys.require("attention.sliding_window"),
                    layer_types=_layer_types(n), query_pre_attn_scalar=float(scalar),
                    attn_logit_softcapping=keys.get("attn_logit_softcapping"),
                    final_logit_softcapping=keys.get("final_logit_softcapping"))


def _layer_types(num_layers: int) -> tuple[str, ...]:
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))


class GemmaDecoderLayer(nn.Module):
    """Gemma's (the first): a (1 + weight) RMSNorm before attention and one before the MLP, each
    sublayer added to the stream as it is (Gemma 2 and 3 normalize their outputs too)."""
    is_sliding = False

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 qk_norm: bool = False) -> None:
        super().__init__()
        c = config
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, backend, dtype,
                                       scale=c.attn_scale, qkv_bias=c.qkv_bias, o_bias=c.o_bias)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)      # the MLP's, before it
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GemmaForCausalLM(Gemma2ForCausalLM):
    """Gemma (2B, 7B, CodeGemma): Gemma 2's embeddings (scaled by sqrt(hidden)), norms and tied head
    with the first generation's layers: no sliding window, no caps, no norms after the sublayers.
    A config's legacy ``hidden_act`` "gelu" means the tanh approximation (transformers' and vLLM's
    reading)."""
    hf_defaults: ClassVar[dict[str, Any]] = {
        "vocab_size": 256_000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "tie_word_embeddings": True}
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    decoder_layer: ClassVar[type[nn.Module]] = GemmaDecoderLayer

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        return dict(sliding_window=None, layer_types=None, rope_local_theta=None, query_pre_attn_scalar=None,
                    attn_logit_softcapping=None, final_logit_softcapping=None,
                    hidden_act="gelu_pytorch_tanh" if act == "gelu" else act)
