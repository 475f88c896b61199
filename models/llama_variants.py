"""Llama's layers under other names, each stated as its differences: Helium (kyutai: an
interleaved rotary, q/k/v biases with ``attention_bias`` and none on the output), ERNIE 4.5
(Baidu's dense models: an interleaved rotary), Seed-OSS (ByteDance: q/k/v biases, the output's by
``attention_out_bias``) and Ministral (Mistral with ``layer_types``: sliding layers beside global
ones). The interleaved rotaries are served as GLM's (models/glm.py): q's and k's rows reordered at
load."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from kernels.attention.base import AttentionBackend
from models.base import TensorMap
from models.config import ArchConfig, Routing
from models.deepseek import DEEPSEEK_MOE_MAP, deepseek_mlp
from models.glm import InterleavedRotary
from models.llama import LlamaForCausalLM
from models.mistral import MistralForCausalLM


class HeliumForCausalLM(InterleavedRotary, LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {"o_bias": False}               # attention_bias is q's, k's and v's


class Ernie4_5ForCausalLM(InterleavedRotary, LlamaForCausalLM):      # noqa: N801 - transformers' name
    gguf_architectures: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("use_bias"):
            raise ValueError("Ernie4_5ForCausalLM with use_bias (biases on the MLP too) is not supported")
        return {"qkv_bias": False, "o_bias": False}


class SeedOssForCausalLM(LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {"qkv_bias": bool(raw.get("attention_bias", True)), "o_bias": bool(raw.get("attention_out_bias", False))}


class MinistralForCausalLM(MistralForCausalLM):
    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        types = raw.get("layer_types")
        window = raw.get("sliding_window")
        if not types or window is None:
            return {"sliding_window": window}
        return {"sliding_window": window, "layer_types": tuple(types)}


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):      # noqa: N801 - transformers' name
    """ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's layers with, in the layers from
    ``moe_layer_start_index`` to ``moe_layer_end_index`` every ``moe_layer_interval``-th,
    ``moe_num_experts`` experts (softmax scores, chosen with a learned correction bias added —
    its ``moe_statics`` — and weighted by the scores renormalized) and ``moe_num_shared_experts``
    shared ones."""
    hf_defaults: ClassVar[dict[str, Any]] = {"moe_num_shared_experts": 0, "moe_layer_start_index": 0,
                                             "moe_layer_end_index": None, "moe_layer_interval": 1,
                                             "tie_word_embeddings": True}
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: v for k, v in LlamaForCausalLM.hf_tensor_map.items()},
        "model.layers.{i}.mlp.moe_statics.e_score_correction_bias":
            ("layers.{i}.mlp.moe.e_score_correction_bias", None),
        **DEEPSEEK_MOE_MAP,
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        n, E = fields["num_layers"], raw["moe_num_experts"]
        E = E[0] if isinstance(E, list) else E               # (a list per modality in multimodal saves)
        start, interval = raw["moe_layer_start_index"], raw["moe_layer_interval"]
        end = n - 1 if raw["moe_layer_end_index"] in (None, -1) else raw["moe_layer_end_index"]
        layers = tuple(i for i in range(n) if (i + 1) % interval == 0 and start <= i <= end)
        return {**super().hf_fields(raw, fields), "num_experts": E, "num_experts_per_tok": raw["moe_k"],
                "moe_intermediate_size": raw["moe_intermediate_size"], "norm_topk_prob": True, "moe_layers": layers,
                "shared_expert_intermediate_size": raw["moe_intermediate_size"] * raw["moe_num_shared_experts"],
                "moe_routing": Routing(correction_bias=True)}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        for i, layer in enumerate(self.layers):
            layer.mlp = deepseek_mlp(config, i, dtype)

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("moe_statics.e_score_correction_bias"):
            return tensor.reshape(-1)                        # (1, E): one group
        return super().hf_rows(name, tensor)
