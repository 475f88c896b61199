"""Phi-3: Llama whose checkpoint stores q|k|v and gate|up already fused (our fused parameters take
them whole), with one optional sliding window for every layer, the 128k models' longrope scaling
(models/rope.py) and Phi-4-mini's partial rotary (``partial_rotary_factor``). llama.cpp
runs it with NeoX rotary, so its GGUF keeps q/k rows as they are; a GGUF's window is applied as
transformers applies config.json's (llama.cpp ignores it)."""
from __future__ import annotations

from typing import Any, ClassVar

from models.base import TensorMap
from models.gguf_loader import GGUFArchKeys
from models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ("phi3",)
    gguf_permuted_qk: ClassVar[bool] = False

    # Llama's maps without the per-shard tensors, plus the fused ones whole
    gguf_tensor_map: ClassVar[TensorMap] = {
        **{name: place for name, place in LlamaForCausalLM.gguf_tensor_map.items() if place[1] is None},
        "blk.{i}.attn_qkv.weight": ("layers.{i}.self_attn.qkv_proj.weight", None),
        "blk.{i}.ffn_up.weight": ("layers.{i}.mlp.gate_up_proj.weight", None),     # gate | up
    }
    hf_tensor_map: ClassVar[TensorMap] = {
        **{name: place for name, place in LlamaForCausalLM.hf_tensor_map.items() if place[1] is None},
        "model.layers.{i}.self_attn.qkv_proj.weight": ("layers.{i}.self_attn.qkv_proj.weight", None),
        "model.layers.{i}.mlp.gate_up_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", None),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """One window for every layer (null: none; the rope and a partial rotary the generic
        parsing reads)."""
        return {"sliding_window": raw.get("sliding_window")}

    @classmethod
    def gguf_fields(cls, keys: GGUFArchKeys, fields: dict[str, Any]) -> dict[str, Any]:
        return {"sliding_window": keys.get("attention.sliding_window") or None}   # 0: no window
