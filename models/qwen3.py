"""Qwen3: Llama with a per-head RMSNorm of q and k before rotary, no q/k/v bias by default."""
from __future__ import annotations

from typing import ClassVar

from models.llama import LlamaForCausalLM, TensorMap


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm: ClassVar[bool] = True

    gguf_tensor_map: ClassVar[TensorMap] = {
        **LlamaForCausalLM.gguf_tensor_map,
        "blk.{i}.attn_q_norm.weight": ("layers.{i}.self_attn.q_norm.weight", None),
        "blk.{i}.attn_k_norm.weight": ("layers.{i}.self_attn.k_norm.weight", None),
    }
    hf_tensor_map: ClassVar[TensorMap] = {
        **LlamaForCausalLM.hf_tensor_map,
        "model.layers.{i}.self_attn.q_norm.weight": ("layers.{i}.self_attn.q_norm.weight", None),
        "model.layers.{i}.self_attn.k_norm.weight": ("layers.{i}.self_attn.k_norm.weight", None),
    }
