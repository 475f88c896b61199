"""Granite (IBM's Granite 3.x): Llama with four multipliers: the input embeddings scaled, each
sublayer's output scaled before the residual add, the attention's own scale in place of
1/sqrt(head_size), and the logits divided; llama.cpp converts it as a "granite" GGUF (q/k rows
permuted as Llama's) with the multipliers as header keys. Granite MoE: the same with a mixture
of experts in every MLP, and a shared expert beside them (GraniteMoeShared)."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from kernels.attention.base import AttentionBackend
from models.base import TensorMap
from models.config import ArchConfig
from models.gguf_loader import GGUFArchKeys
from models.layers import GatedMLP
from models.llama import LlamaForCausalLM
from models.moe import SharedExpertMoE
from models.qwen3_moe import num_experts, use_moe_layers


class GraniteForCausalLM(LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ("granite",)

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return _multipliers(float(raw.get("embedding_multiplier", 1.0)), float(raw.get("residual_multiplier", 1.0)),
                            float(raw.get("attention_multiplier", 1.0)), float(raw.get("logits_scaling", 1.0)))

    @classmethod
    def gguf_fields(cls, keys: GGUFArchKeys, fields: dict[str, Any]) -> dict[str, Any]:
        return _multipliers(float(keys.get("embedding_scale", 1.0)), float(keys.get("residual_scale", 1.0)),
                            float(keys.require("attention.scale")), float(keys.get("logit_scale", 1.0)))


def _multipliers(embedding: float, residual: float, attention: float, logits: float) -> dict[str, Any]:
    if not attention > 0 or not logits:
        raise ValueError(f"Granite's attention_multiplier ({attention}) must be positive and its logits_scaling "
                         f"({logits}) non-zero")
    # the attention scale is query_pre_attn_scalar ** -0.5 (models/config.py)
    return dict(embedding_multiplier=embedding, residual_multiplier=residual, logits_scaling=logits,
                query_pre_attn_scalar=attention ** -2)


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite 3.x MoE (granite-3.0-1b-a400m, 3b-a800m): Granite's multipliers around layers whose
    MLP is a mixture of ``num_local_experts`` SiLU-gated experts of ``intermediate_size`` (the top
    ``num_experts_per_tok`` logits' softmax: the renormalized top-k), its experts stacked in the
    checkpoint as ours are (gate rows then up rows)."""
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: v for k, v in GraniteForCausalLM.hf_tensor_map.items() if ".mlp." not in k},
        # the hub's names, and transformers 5's
        "model.layers.{i}.block_sparse_moe.router.layer.weight": ("layers.{i}.mlp.gate.weight", None),
        "model.layers.{i}.block_sparse_moe.input_linear.weight": ("layers.{i}.mlp.w13_weight", None),
        "model.layers.{i}.block_sparse_moe.output_linear.weight": ("layers.{i}.mlp.w2_weight", None),
        "model.layers.{i}.block_sparse_moe.router.weight": ("layers.{i}.mlp.gate.weight", None),
        "model.layers.{i}.block_sparse_moe.experts.gate_up_proj": ("layers.{i}.mlp.w13_weight", None),
        "model.layers.{i}.block_sparse_moe.experts.down_proj": ("layers.{i}.mlp.w2_weight", None),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {**super().hf_fields(raw, fields), "num_experts": num_experts(raw, "num_local_experts", "num_experts"),
                "num_experts_per_tok": raw["num_experts_per_tok"], "moe_intermediate_size": fields["intermediate_size"],
                "norm_topk_prob": True}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        use_moe_layers(self, config, dtype)


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE with a shared expert of ``shared_intermediate_size`` beside the routed ones
    (none where it is 0)."""
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: (v[0].replace(".mlp.", ".mlp.moe."), v[1]) for k, v in GraniteMoeForCausalLM.hf_tensor_map.items()
           if ".block_sparse_moe." in k},
        **{k: v for k, v in GraniteMoeForCausalLM.hf_tensor_map.items() if ".block_sparse_moe." not in k},
        "model.layers.{i}.shared_mlp.input_linear.weight": ("layers.{i}.mlp.shared_mlp.gate_up_proj.weight", None),
        "model.layers.{i}.shared_mlp.output_linear.weight": ("layers.{i}.mlp.shared_mlp.down_proj.weight", None),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {**super().hf_fields(raw, fields), "shared_expert_intermediate_size": int(raw.get("shared_intermediate_size") or 0)}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        if config.shared_expert_intermediate_size:
            for layer in self.layers:
                layer.mlp = SharedExpertMoE(layer.mlp, GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                                                config.hidden_act, dtype))
