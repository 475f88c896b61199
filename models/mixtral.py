"""Mixtral: Mistral whose every MLP is a mixture of ``num_local_experts`` experts of
``intermediate_size`` (models/moe.py), the top-k routing weights always renormalized; the
checkpoint's per-expert w1 (gate), w3 (up) and w2 (down) are stacked at load."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from kernels.attention.base import AttentionBackend
from models.base import TensorMap
from models.config import ArchConfig
from models.llama import LlamaForCausalLM
from models.mistral import MistralForCausalLM
from models.qwen3_moe import num_experts, use_moe_layers


class MixtralForCausalLM(MistralForCausalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {"sliding_window": None}
    gguf_architectures: ClassVar[tuple[str, ...]] = ()    # its GGUF form is not read

    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: v for k, v in LlamaForCausalLM.hf_tensor_map.items() if ".mlp." not in k},
        "model.layers.{i}.block_sparse_moe.gate.weight": ("layers.{i}.mlp.gate.weight", None),
        "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight": ("layers.{i}.mlp.w13_weight", "gate.{e}"),
        "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight": ("layers.{i}.mlp.w13_weight", "up.{e}"),
        "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight": ("layers.{i}.mlp.w2_weight", "down.{e}"),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {**super().hf_fields(raw, fields), "num_experts": num_experts(raw, "num_local_experts", "num_experts"),
                "num_experts_per_tok": raw["num_experts_per_tok"],
                "moe_intermediate_size": fields["intermediate_size"], "norm_topk_prob": True}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        use_moe_layers(self, config, dtype)
