"""StarCoder2 (``Starcoder2ForCausalLM``) and Phi-2 (``PhiForCausalLM``): decoders with LayerNorms
(weight and bias) and an ungated GELU MLP, biases throughout. StarCoder2's layers are Llama's
order (norm, attention, add; norm, MLP, add), with one sliding window for every layer where the
config sets one; Phi's are a parallel block (one norm read by attention and the MLP, both added
to the stream), its rotary over a share of each head and its LM head with a bias."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import TensorMap
from models.bert import LayerNorm
from models.config import ArchConfig
from models.gemma3 import LocalGlobalLM
from models.layers import MLP, Embedding, Linear, RotaryEmbedding, SelfAttention, hf_activation


class _Layer(nn.Module):
    is_sliding = False          # one rotary table for every layer

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 parallel: bool) -> None:
        super().__init__()
        c = config
        self.parallel = parallel
        self.input_layernorm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, backend, dtype, scale=c.attn_scale,
            sliding_window=c.layer_sliding_window(layer), qkv_bias=c.qkv_bias, o_bias=c.o_bias,
            rotary_dim=c.rotary_dim)
        if not parallel:
            self.post_attention_layernorm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, hf_activation(c.hidden_act, c.architecture), dtype,
                       bias=c.o_bias)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(normed, cos, sin, kv_cache, meta)
        if self.parallel:
            return hidden + attn + self.mlp(normed)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _layer_map(names: dict[str, str]) -> TensorMap:
    return {f"model.layers.{{i}}.{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in names.items()
            for p in ("weight", "bias")}


class Starcoder2ForCausalLM(LocalGlobalLM):
    parallel: ClassVar[bool] = False
    hf_defaults: ClassVar[dict[str, Any]] = {"norm_epsilon": 1e-5, "use_bias": True, "hidden_act": "gelu_pytorch_tanh",
                                             "tie_word_embeddings": True}
    hf_tensor_map: ClassVar[TensorMap] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        **{f"model.layers.{{i}}.self_attn.{s}_proj.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", s)
           for s in "qkv" for p in ("weight", "bias")},
        **_layer_map({"input_layernorm": "input_layernorm", "self_attn.o_proj": "self_attn.o_proj",
                      "post_attention_layernorm": "post_attention_layernorm", "mlp.c_fc": "mlp.up_proj",
                      "mlp.c_proj": "mlp.down_proj"}),
        **{f"model.norm.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
        "lm_head.weight": ("lm_head.weight", None),
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "rms_norm_eps": raw["norm_epsilon"]}        # its LayerNorms' epsilon

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        bias = bool(raw["use_bias"])
        return {"qkv_bias": bias, "o_bias": bias, "sliding_window": raw.get("sliding_window")}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = self.config = config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.rotary_global = RotaryEmbedding(c.rotary_dim or c.head_size, c.rope_positions, c.rope_theta,
                                             c.rope_scaling, c.serving_len)
        self.rotary_local = None
        self.layers = nn.ModuleList(_Layer(c, i, attn_backend, dtype, self.parallel) for i in range(c.num_layers))
        self.start_layer, self.end_layer = 0, c.num_layers     # a pipeline stage's (pipeline_parallel.py)
        self.norm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype)
        tied = self.embed_tokens.weight if c.tie_word_embeddings else None
        self.lm_head = Linear(c.hidden_size, c.vocab_size, dtype, weight=tied, bias=self.lm_head_bias)

    lm_head_bias: ClassVar[bool] = False

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class PhiForCausalLM(Starcoder2ForCausalLM):
    """Phi-2 (and Phi-1.5): a parallel block, ``partial_rotary_factor`` of each head turning, the
    output projection named ``dense``, the MLP ``fc1``/``fc2``, the final norm ``final_layernorm``,
    an LM head with a bias."""
    parallel: ClassVar[bool] = True
    lm_head_bias: ClassVar[bool] = True
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_eps": 1e-5, "hidden_act": "gelu_new",
                                             "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
                                             "qk_layernorm": False}
    hf_tensor_map: ClassVar[TensorMap] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        **{f"model.layers.{{i}}.self_attn.{s}_proj.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", s)
           for s in "qkv" for p in ("weight", "bias")},
        **_layer_map({"input_layernorm": "input_layernorm", "self_attn.dense": "self_attn.o_proj",
                      "mlp.fc1": "mlp.up_proj", "mlp.fc2": "mlp.down_proj"}),
        **{f"model.final_layernorm.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
        **{f"lm_head.{p}": (f"lm_head.{p}", None) for p in ("weight", "bias")},
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "rms_norm_eps": raw["layer_norm_eps"]}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("qk_layernorm"):
            raise ValueError("PhiForCausalLM with qk_layernorm is not supported")
        return {"qkv_bias": True, "o_bias": True, "sliding_window": None}
