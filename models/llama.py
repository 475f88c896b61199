"""The Llama architecture (SmolLM2, Llama 2/3 without rope scaling) over a paged KV cache."""
from __future__ import annotations

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.config import ModelConfig
from models.layers import (Embedding, Linear, MergedLinear, RMSNorm, RotaryEmbedding, apply_rotary,
                           silu_and_mul)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        if config.num_heads % config.num_kv_heads:
            raise ValueError(f"num_heads {config.num_heads} is not a multiple of num_kv_heads {config.num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_size = config.num_heads, config.num_kv_heads, config.head_size
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.scale = self.head_size ** -0.5
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, dtype)
        self.backend = backend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(T, self.num_heads, self.head_size), cos, sin)     # (T, H, D)
        k = apply_rotary(k.view(T, self.num_kv_heads, self.head_size), cos, sin)  # (T, KVH, D)
        v = v.view(T, self.num_kv_heads, self.head_size)                          # (T, KVH, D)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)           # (T, H, D)
        return self.o_proj(out.reshape(T, self.q_size))                           # (T, hidden)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, dtype)
        self.down_proj = Linear(size, config.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, backend, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensor name -> (our parameter, shard of a fused parameter or None).
    # "{i}" stands for the layer index. The loaders only look names up here.
    gguf_tensor_map: dict[str, tuple[str, str | None]] = {
        "token_embd.weight": ("embed_tokens.weight", None),
        "blk.{i}.attn_norm.weight": ("layers.{i}.input_layernorm.weight", None),
        "blk.{i}.attn_q.weight": ("layers.{i}.self_attn.qkv_proj.weight", "q"),
        "blk.{i}.attn_k.weight": ("layers.{i}.self_attn.qkv_proj.weight", "k"),
        "blk.{i}.attn_v.weight": ("layers.{i}.self_attn.qkv_proj.weight", "v"),
        "blk.{i}.attn_output.weight": ("layers.{i}.self_attn.o_proj.weight", None),
        "blk.{i}.ffn_norm.weight": ("layers.{i}.post_attention_layernorm.weight", None),
        "blk.{i}.ffn_gate.weight": ("layers.{i}.mlp.gate_up_proj.weight", "gate"),
        "blk.{i}.ffn_up.weight": ("layers.{i}.mlp.gate_up_proj.weight", "up"),
        "blk.{i}.ffn_down.weight": ("layers.{i}.mlp.down_proj.weight", None),
        "output_norm.weight": ("norm.weight", None),
        "output.weight": ("lm_head.weight", None),
    }
    hf_tensor_map: dict[str, tuple[str, str | None]] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        "model.layers.{i}.input_layernorm.weight": ("layers.{i}.input_layernorm.weight", None),
        "model.layers.{i}.self_attn.q_proj.weight": ("layers.{i}.self_attn.qkv_proj.weight", "q"),
        "model.layers.{i}.self_attn.k_proj.weight": ("layers.{i}.self_attn.qkv_proj.weight", "k"),
        "model.layers.{i}.self_attn.v_proj.weight": ("layers.{i}.self_attn.qkv_proj.weight", "v"),
        "model.layers.{i}.self_attn.o_proj.weight": ("layers.{i}.self_attn.o_proj.weight", None),
        "model.layers.{i}.post_attention_layernorm.weight": ("layers.{i}.post_attention_layernorm.weight", None),
        "model.layers.{i}.mlp.gate_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", "gate"),
        "model.layers.{i}.mlp.up_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", "up"),
        "model.layers.{i}.mlp.down_proj.weight": ("layers.{i}.mlp.down_proj.weight", None),
        "model.norm.weight": ("norm.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
    }

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.rotary_emb = RotaryEmbedding(config.head_size, config.max_model_len, config.rope_theta)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attn_backend, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        tied = self.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype, weight=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions (T,) int64; kv_caches[l] (2, num_blocks, block_size, KVH, D)
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)                  # (T, hidden)
        cos, sin = self.rotary_emb(positions, hidden.dtype)    # (T, 1, D) each
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return self.norm(hidden)                               # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                    # (N, hidden) -> (N, vocab) float32
