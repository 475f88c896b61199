"""OLMo 2 and OLMo 3 (AllenAI's open models): Llama's attention and SiLU-gated MLP with the norms
moved after them (each sublayer's output normalized before its residual add; no norm before),
and RMSNorms of q and k over the whole projection (every head's features at once) before
rotary. OLMo 3 adds sliding-window layers (``layer_types``; by default every fourth layer
global), its config's rope scaling on the global layers only. OLMoE: Llama's layers (norms
before) with those q/k norms and a mixture of experts in every MLP (models/moe.py). EXAONE 4.0:
OLMo 2's layer order with per-head q/k norms and no rotary in a hybrid model's global layers."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import TensorMap
from models.config import FULL, SLIDING, ArchConfig
from models.gemma3 import LocalGlobalLM
from models.hf_config import rope_parameters
from models.layers import GatedMLP, RMSNorm, SelfAttention
from models.llama import LlamaForCausalLM
from models.qwen3_moe import Qwen3MoeForCausalLM, num_experts, use_moe_layers


class Olmo2RMSNorm(RMSNorm):
    """RMSNorm as OLMo's: in a 16-bit dtype the weight multiplies the float32 normalized values,
    rounded once (Llama's rounds them first); the same in float32."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super()._norm(x)
        return (self.weight.float() * F.rms_norm(x.float(), self.weight.shape, None, self.eps)).to(x.dtype)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.is_sliding = c.layer_types is not None and c.layer_types[layer] == SLIDING
        self.self_attn = SelfAttention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, backend, dtype, scale=c.attn_scale,
            sliding_window=c.layer_sliding_window(layer), qkv_bias=c.qkv_bias, o_bias=c.o_bias,
            qk_norm_whole=lambda size: Olmo2RMSNorm(size, c.rms_norm_eps, dtype))
        self.post_attention_layernorm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype)
        self.post_feedforward_layernorm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, cos, sin, kv_cache, meta))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


_LAYER = ("self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm",
          "post_feedforward_layernorm", "mlp.down_proj")
_FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", "q"), "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
          "self_attn.v_proj": ("self_attn.qkv_proj", "v"), "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
          "mlp.up_proj": ("mlp.gate_up_proj", "up")}


class Olmo2ForCausalLM(LocalGlobalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {"rms_norm_eps": 1e-5}
    hf_tensor_map: ClassVar[TensorMap] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        **{f"model.layers.{{i}}.{name}.weight": (f"layers.{{i}}.{name}.weight", None) for name in _LAYER},
        **{f"model.layers.{{i}}.{theirs}.weight": (f"layers.{{i}}.{ours}.weight", shard)
           for theirs, (ours, shard) in _FUSED.items()},
        "model.norm.weight": ("norm.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
    }

    decoder_layer: ClassVar[type[nn.Module]] = Olmo2DecoderLayer       # (config, layer, backend, dtype)
    final_norm: ClassVar[type[nn.Module]] = Olmo2RMSNorm

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.rotary_dim is not None:
            raise ValueError(f"{type(self).__name__} with a partial rotary is not supported")
        self.build(config, dtype, lambda i: self.decoder_layer(config, i, attn_backend, dtype),
                   self.final_norm(config.hidden_size, config.rms_norm_eps, dtype), local=self.local_rotary(config))

    @classmethod
    def local_rotary(cls, config: ArchConfig) -> bool:
        """Whether the sliding layers turn by a rotary of their own (OLMo 3's plain one)."""
        return config.layer_types is not None and SLIDING in config.layer_types

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2's layers, most of them sliding (``layer_types``, else every fourth layer
    global, transformers' default), the config's rope scaling on the global ones only."""

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        n = fields["num_layers"]
        types = tuple(raw.get("layer_types") or (SLIDING if (i + 1) % 4 else FULL for i in range(n)))
        local_theta, local_scaling = rope_parameters(raw, SLIDING) if isinstance(raw.get("rope_parameters"), dict) \
            and SLIDING in raw["rope_parameters"] else (fields["rope_theta"], None)
        if local_scaling is not None and not local_scaling.is_default:
            raise ValueError(f"OLMo 3's sliding layers with {local_scaling.rope_type} rope scaling are not supported "
                             "(their rope is plain)")
        return dict(sliding_window=raw.get("sliding_window"), layer_types=types, rope_local_theta=local_theta)


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE: Llama's pre-norm layers, q/k RMSNorms over the whole projections, every MLP a
    mixture of ``num_experts`` experts of ``intermediate_size`` (top ``num_experts_per_tok``, their
    weights renormalized only with ``norm_topk_prob``), named as Qwen3-MoE's."""
    qk_norm_whole: ClassVar[bool] = True
    hf_defaults: ClassVar[dict[str, Any]] = {"rms_norm_eps": 1e-5, "norm_topk_prob": False}
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_tensor_map: ClassVar[TensorMap] = Qwen3MoeForCausalLM.hf_tensor_map     # the same names

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("clip_qkv") is not None:
            raise ValueError("OLMoE with clip_qkv is not supported")
        return {"num_experts": num_experts(raw), "num_experts_per_tok": raw["num_experts_per_tok"],
                "moe_intermediate_size": fields["intermediate_size"], "norm_topk_prob": bool(raw["norm_topk_prob"]),
                "moe_layers": tuple(range(fields["num_layers"]))}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        use_moe_layers(self, config, dtype)


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    """EXAONE 4.0's layer: OLMo 2's norms after attention and the MLP, per-head q/k RMSNorms,
    no rotary in the global layers of a model with sliding ones."""

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        c = config
        self.is_sliding = False             # one rotary: the global layers of a hybrid model turn none
        self.self_attn = SelfAttention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, backend, dtype, scale=c.attn_scale,
            sliding_window=c.layer_sliding_window(layer), qk_norm=lambda: RMSNorm(c.head_size, c.rms_norm_eps, dtype),
            use_rope=c.layer_uses_rope(layer))
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype)
        self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    decoder_layer: ClassVar[type[nn.Module]] = Exaone4DecoderLayer
    final_norm: ClassVar[type[nn.Module]] = RMSNorm
    """EXAONE 4.0 (LG AI Research, 1.2B and 32B): OLMo 2's layer order with per-head q/k norms
    (Llama's RMSNorm); with a ``sliding_window``, the layers of ``layer_types`` (else
    ``sliding_window_pattern``: every n-th global, or a string such as "LLLG") slide and the
    global ones attend with no rotary; without one, every layer is global with rotary."""
    hf_defaults: ClassVar[dict[str, Any]] = {"rms_norm_eps": 1e-5, "sliding_window": None,
                                             "sliding_window_pattern": 4}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        n, window = fields["num_layers"], raw.get("sliding_window")
        if window is None:
            return {"sliding_window": None, "layer_types": None, "rope_layers": None}
        pattern = raw.get("sliding_window_pattern") or 4
        if isinstance(pattern, str):
            default = tuple(FULL if pattern[i % len(pattern)] == "G" else SLIDING for i in range(n))
        else:
            default = tuple(FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(n))
        types = tuple(raw.get("layer_types") or default)
        return {"sliding_window": window, "layer_types": types, "rope_layers": tuple(t == SLIDING for t in types)}

    @classmethod
    def local_rotary(cls, config: ArchConfig) -> bool:
        return False                        # the sliding layers turn by the config's rotary
