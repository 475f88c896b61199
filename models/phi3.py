"""Phi-3: Llama whose checkpoint stores q|k|v and gate|up already fused (our fused parameters take
them whole), with one optional sliding window for every layer. Refused: a partial rotary
(``partial_rotary_factor`` < 1, Phi-4-mini) and longrope scaling (the 128k models). llama.cpp
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
        """One window for every layer (null: none); the rotary must cover the whole head (the
        rope type itself the generic parsing checks: longrope is refused there)."""
        rope = raw.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"Phi3ForCausalLM with partial_rotary_factor={partial} is not supported; "
                             f"rotary over the whole head only")
        return {"sliding_window": raw.get("sliding_window")}

    @classmethod
    def gguf_fields(cls, keys: GGUFArchKeys, fields: dict[str, Any]) -> dict[str, Any]:
        if keys.get("rope.scaling.attn_factor") is not None:
            raise ValueError(f"{keys.path}: a phi3 GGUF with longrope scaling (rope_factors tensors) is not supported")
        rotary = keys.get("rope.dimension_count", fields["head_size"])
        if rotary != fields["head_size"]:
            raise ValueError(f"{keys.path}: phi3 rotary over {rotary} of {fields['head_size']} head dimensions "
                             f"(a partial rotary) is not supported")
        return {"sliding_window": keys.get("attention.sliding_window") or None}   # 0: no window
