"""Decoders with LayerNorms (weight and bias) and an ungated GELU MLP, biases throughout:
StarCoder2 (``Starcoder2ForCausalLM``: Llama's order of sublayers, norm, attention, add; norm, MLP,
add; one sliding window for every layer where the config sets one), Phi-2 (``PhiForCausalLM``: a
parallel block, one norm read by attention and the MLP, both added to the stream; a rotary over
a share of each head; an LM head with a bias) and GPT-NeoX (``GPTNeoXForCausalLM``, Pythia: a
parallel block with a norm for each side, or Llama's order, its q|k|v rows head by head in the
checkpoint, put in the fused projection's order at load)."""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import TensorMap
from models.bert import LayerNorm
from models.config import ArchConfig
from models.gemma3 import LocalGlobalLM
from models.layers import MLP, SelfAttention, hf_activation


SEQUENTIAL, PARALLEL, PARALLEL_TWO_NORMS = "sequential", "parallel", "parallel, two norms"
_NEOX_BUFFERS = ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq")


class _Layer(nn.Module):
    is_sliding = False          # one rotary table for every layer

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 block: str) -> None:
        super().__init__()
        c = config
        self.block = block
        self.input_layernorm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, backend, dtype, scale=c.attn_scale,
            sliding_window=c.layer_sliding_window(layer), qkv_bias=c.qkv_bias, o_bias=c.o_bias,
            rotary_dim=c.rotary_dim)
        if block != PARALLEL:
            self.post_attention_layernorm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, hf_activation(c.hidden_act, c.architecture), dtype,
                       bias=c.o_bias)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(normed, cos, sin, kv_cache, meta)
        if self.block == PARALLEL:
            return hidden + attn + self.mlp(normed)
        if self.block == PARALLEL_TWO_NORMS:
            return hidden + attn + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _layer_map(names: dict[str, str]) -> TensorMap:
    return {f"model.layers.{{i}}.{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in names.items()
            for p in ("weight", "bias")}


class Starcoder2ForCausalLM(LocalGlobalLM):
    block: ClassVar[str] = SEQUENTIAL
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
        block = self.layer_block(config)
        self.build(config, dtype, lambda i: _Layer(config, i, attn_backend, dtype, block),
                   LayerNorm(config.hidden_size, config.rms_norm_eps, dtype), local=False,
                   lm_head_bias=self.lm_head_bias)

    lm_head_bias: ClassVar[bool] = False

    def layer_block(self, config: ArchConfig) -> str:
        """How each layer adds its sublayers (SEQUENTIAL, PARALLEL, PARALLEL_TWO_NORMS)."""
        return self.block

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class PhiForCausalLM(Starcoder2ForCausalLM):
    """Phi-2 (and Phi-1.5): a parallel block, ``partial_rotary_factor`` of each head turning, the
    output projection named ``dense``, the MLP ``fc1``/``fc2``, the final norm ``final_layernorm``,
    an LM head with a bias."""
    block: ClassVar[str] = PARALLEL
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


class GPTNeoXForCausalLM(Starcoder2ForCausalLM):
    """GPT-NeoX (Pythia): ``use_parallel_residual`` (the default) adds attention of one norm and the
    MLP of another to the stream together; otherwise Llama's order. ``rotary_pct`` of each head
    turns (half-split, NeoX's own style)."""
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_eps": 1e-5, "hidden_act": "gelu", "rotary_pct": 0.25,
                                             "rotary_emb_base": 10_000, "tie_word_embeddings": False,
                                             "use_parallel_residual": True, "attention_bias": True}
    hf_tensor_map: ClassVar[TensorMap] = {
        "gpt_neox.embed_in.weight": ("embed_tokens.weight", None),
        **{f"gpt_neox.layers.{{i}}.attention.query_key_value.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", None)
           for p in ("weight", "bias")},
        **{f"gpt_neox.layers.{{i}}.{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in (
            ("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_attention_layernorm"),
            ("attention.dense", "self_attn.o_proj"), ("mlp.dense_h_to_4h", "mlp.up_proj"),
            ("mlp.dense_4h_to_h", "mlp.down_proj")) for p in ("weight", "bias")},
        **{f"gpt_neox.final_layer_norm.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
        "embed_out.weight": ("lm_head.weight", None),
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        out = {**raw, "rms_norm_eps": raw["layer_norm_eps"], "rope_theta": raw.get("rope_theta", raw["rotary_emb_base"])}
        if raw.get("rope_parameters") is None and "partial_rotary_factor" not in raw:
            out["partial_rotary_factor"] = raw["rotary_pct"]
        return out

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        bias = bool(raw["attention_bias"])
        return {"qkv_bias": bias, "o_bias": bias, "sliding_window": None,
                "parallel_residual": bool(raw["use_parallel_residual"])}

    def layer_block(self, config: ArchConfig) -> str:
        return PARALLEL_TWO_NORMS if config.parallel_residual else SEQUENTIAL

    def hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        # older saves hold the attention's causal mask and rotary frequencies as buffers: not weights
        kept = ((n, t) for n, t in weights if not n.endswith(_NEOX_BUFFERS))
        return super().hf_weights(kept)

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(("attention.query_key_value.weight", "attention.query_key_value.bias")):
            D, H = self.config.head_size, self.config.num_heads      # (H, 3, D) rows -> (3, H, D)
            return tensor.reshape(H, 3, D, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)
        return tensor
