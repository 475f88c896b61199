"""GLM (``GlmForCausalLM``: GLM-4-9B's "hf" checkpoints) and GLM-4 (``Glm4ForCausalLM``: the
GLM-4-0414 models): Llama's layers with q/k/v biases (none on the output projection), gate|up in
one tensor, and a rotary over the first half of each head (``partial_rotary_factor`` 0.5) that
turns interleaved pairs of dimensions (0 with 1, 2 with 3, ...). The kernels turn half-split
pairs (i with i + d/2), so q's and k's rows are put in that order at load: each head's rotary
rows evens first, then odds (the attention scores are unchanged, as q and k move together; a
LoRA adapter's B rows are reordered the same way). GLM-4 adds a norm after attention and one
after the MLP, each before its residual add. GLM-4.5 (``Glm4MoeForCausalLM``): Llama's layers
around DeepSeek-V3's experts."""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import TensorMap
from models.config import ArchConfig
from models.deepseek import DEEPSEEK_MOE_MAP, deepseek_mlp, deepseek_moe_fields, skip_layers_past
from models.layers import RMSNorm
from models.llama import LlamaDecoderLayer, LlamaForCausalLM
from models.rope import interleaved_to_half_split


class InterleavedRotary:
    """A model whose rotary turns interleaved pairs: q's and k's checkpoint rows (and a LoRA
    adapter's B rows for them) reordered to the kernels' half-split pairs at load."""

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        c = self.config
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                          "self_attn.k_proj.bias")):
            return interleaved_to_half_split(tensor, c.head_size, c.rotary_dim or c.head_size)
        return tensor


class GlmForCausalLM(InterleavedRotary, LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_defaults: ClassVar[dict[str, Any]] = {"partial_rotary_factor": 0.5, "attention_bias": True,
                                             "rms_norm_eps": 1.5625e-07}
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: v for k, v in LlamaForCausalLM.hf_tensor_map.items() if ".mlp.gate_proj" not in k and ".mlp.up_proj" not in k},
        "model.layers.{i}.mlp.gate_up_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", None),   # gate, then up
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {"o_bias": False}             # attention_bias is q's, k's and v's


class Glm4DecoderLayer(LlamaDecoderLayer):
    """GLM-4's layer: norm, attention, norm, residual add; norm, MLP, norm, residual add. Carried as
    Llama's (``hidden`` + ``residual`` is the stream entering it), so the next layer's, or the final,
    norm adds the last MLP output."""

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 qk_norm: bool = False, qk_norm_whole: bool = False) -> None:
        super().__init__(config, layer, backend, dtype, qk_norm, qk_norm_whole)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else hidden + residual
        stream = stream + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(stream), cos, sin,
                                                                       kv_cache, meta))
        return self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(stream))), stream


class Glm4ForCausalLM(GlmForCausalLM):
    decoder_layer: ClassVar[type[nn.Module]] = Glm4DecoderLayer
    hf_tensor_map: ClassVar[TensorMap] = {
        **GlmForCausalLM.hf_tensor_map,
        **{f"model.layers.{{i}}.{n}.weight": (f"layers.{{i}}.{n}.weight", None)
           for n in ("post_self_attn_layernorm", "post_mlp_layernorm")},
    }


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5 and GLM-4.6 (``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air): Llama's layers with q/k/v
    biases (``attention_bias``), per-head q/k RMSNorms where ``use_qk_norm``, a half-split rotary
    over ``partial_rotary_factor`` of each head, and past ``first_k_dense_replace`` DeepSeek-V3's
    experts (sigmoid scores with a correction bias, groups, ``routed_scaling_factor``) with shared
    ones (models/deepseek.py); the multi-token-prediction layers past the model's left unread."""
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_defaults: ClassVar[dict[str, Any]] = {"attention_bias": False, "use_qk_norm": False,
                                             "partial_rotary_factor": 0.5, "first_k_dense_replace": 1,
                                             "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
                                             "routed_scaling_factor": 1.0, "norm_topk_prob": True,
                                             "n_shared_experts": 1, "n_routed_experts": 128}
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: v for k, v in LlamaForCausalLM.hf_tensor_map.items()},
        **{f"model.layers.{{i}}.self_attn.{n}.weight": (f"layers.{{i}}.self_attn.{n}.weight", None)
           for n in ("q_norm", "k_norm")},
        **DEEPSEEK_MOE_MAP,
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {"o_bias": False, "qk_norm": bool(raw["use_qk_norm"]),
                **deepseek_moe_fields(raw, fields["num_layers"], "noaux_tc", sigmoid=True)}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        for i, layer in enumerate(self.layers):
            layer.mlp = deepseek_mlp(config, i, dtype)

    def hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return super().hf_weights(skip_layers_past(weights, self.config.num_layers))
