"""LFM2 (Liquid AI's LFM2-350M to 2.6B): Llama's layers (per-head q/k RMSNorms in attention) with a
short gated convolution in place of attention in most of them (``layer_types`` "conv"):

    B, C, x = in_proj(h);  y = C * conv(B * x);  out_proj(y)

a depthwise causal convolution over ``conv_L_cache`` tokens, no activation, continued from the
request's last inputs in its state slot (MambaDims version 4: the convolution's inputs are its
whole state). The final norm is the checkpoint's ``embedding_norm``.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from models.base import TensorMap
from models.config import ArchConfig, MambaDims
from models.layers import Linear
from models.llama import LlamaForCausalLM
from models.mamba import CausalConv1d, HybridDecoderLayer, StateSteps


class ShortConv(nn.Module):
    def __init__(self, hidden_size: int, dims: MambaDims, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.in_proj = Linear(hidden_size, 3 * hidden_size, dtype, bias=dims.conv_bias)
        self.conv1d = CausalConv1d(hidden_size, dims.d_conv, dims.conv_bias, dtype, silu=False)
        self.out_proj = Linear(hidden_size, hidden_size, dtype, bias=dims.conv_bias)

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], steps: StateSteps
                ) -> torch.Tensor:
        B, C, x = self.in_proj(hidden).chunk(3, -1)
        return self.out_proj(C * self.conv1d(B * x, state[0], steps).to(C.dtype))


class Lfm2DecoderLayer(HybridDecoderLayer):
    def make_mixer(self, config: ArchConfig, dtype: torch.dtype) -> nn.Module:
        return ShortConv(config.hidden_size, config.mamba, dtype)


def lfm2_intermediate_size(raw: dict[str, Any]) -> int:
    """The MLP's width as LFM2 derives it (``block_auto_adjust_ff_dim``: two thirds, times
    ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``)."""
    size = raw["intermediate_size"]
    if not raw.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    if raw.get("block_ffn_dim_multiplier") is not None:
        size = int(raw["block_ffn_dim_multiplier"] * size)
        multiple = raw.get("block_multiple_of", 256)
        size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2ForCausalLM(LlamaForCausalLM):
    qk_norm: ClassVar[bool] = True
    decoder_layer: ClassVar[type[nn.Module]] = Lfm2DecoderLayer
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_defaults: ClassVar[dict[str, Any]] = {"conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-5,
                                             "tie_word_embeddings": True}
    hf_tensor_map: ClassVar[TensorMap] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        "model.embedding_norm.weight": ("norm.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
        "model.layers.{i}.operator_norm.weight": ("layers.{i}.input_layernorm.weight", None),
        "model.layers.{i}.ffn_norm.weight": ("layers.{i}.post_attention_layernorm.weight", None),
        "model.layers.{i}.feed_forward.w1.weight": ("layers.{i}.mlp.gate_up_proj.weight", "gate"),
        "model.layers.{i}.feed_forward.w3.weight": ("layers.{i}.mlp.gate_up_proj.weight", "up"),
        "model.layers.{i}.feed_forward.w2.weight": ("layers.{i}.mlp.down_proj.weight", None),
        **{f"model.layers.{{i}}.self_attn.{s}_proj.weight": ("layers.{i}.self_attn.qkv_proj.weight", s) for s in "qkv"},
        "model.layers.{i}.self_attn.out_proj.weight": ("layers.{i}.self_attn.o_proj.weight", None),
        "model.layers.{i}.self_attn.q_layernorm.weight": ("layers.{i}.self_attn.q_norm.weight", None),
        "model.layers.{i}.self_attn.k_layernorm.weight": ("layers.{i}.self_attn.k_norm.weight", None),
        **{f"model.layers.{{i}}.conv.{name}": (f"layers.{{i}}.mamba.{name}", None) for name in (
            "in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias")},
        "model.layers.{i}.conv.conv.weight": ("layers.{i}.mamba.conv1d.weight", None),
        "model.layers.{i}.conv.conv.bias": ("layers.{i}.mamba.conv1d.bias", None),
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "rms_norm_eps": raw["norm_eps"], "intermediate_size": lfm2_intermediate_size(raw)}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        types = raw.get("layer_types")
        if types:
            conv = tuple(i for i, t in enumerate(types) if t == "conv")
        else:                                   # older configs: the attention layers' indices
            attention = set(raw.get("full_attn_idxs") or ())
            conv = tuple(i for i in range(fields["num_layers"]) if i not in attention)
        if not conv:
            return {}
        dims = MambaDims(4, fields["hidden_size"], 0, raw["conv_L_cache"], conv_bias=bool(raw["conv_bias"]))
        return {"mamba": dims, "mamba_layers": conv}
