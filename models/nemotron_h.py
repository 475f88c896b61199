"""Nemotron-H (NVIDIA's Nemotron-H, Nemotron Nano 2): a stack of blocks, each one RMSNorm and one
mixer added to the residual stream, the mixer a Mamba-2 layer ("M" in ``hybrid_override_pattern``),
attention without positions ("*") or a squared-ReLU MLP ("-"). An MLP block holds no cache
(ArchConfig.mixerless_layers); the mixture-of-experts blocks ("E", Nemotron 3) are refused by name.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import CausalLM, TensorMap
from models.config import ArchConfig
from models.layers import MLP, Embedding, Linear, RMSNorm, SelfAttention, hf_activation
from models.mamba import MAMBA2_MIXER, MambaMixer, StateSteps, mamba2_dims

KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe",          # the hub's pattern
         "linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}   # transformers 5's


def block_kinds(raw: dict[str, Any]) -> list[str]:
    pattern = raw.get("hybrid_override_pattern") or raw.get("layers_block_type") or raw.get("layer_types")
    if not pattern:
        raise ValueError("NemotronHForCausalLM's config.json needs hybrid_override_pattern (or layers_block_type)")
    unknown = sorted({str(k) for k in pattern if k not in KINDS})
    if unknown:
        raise ValueError(f"NemotronHForCausalLM: unknown block types {unknown}")
    kinds = [KINDS[k] for k in pattern]
    if "moe" in kinds:
        raise ValueError("NemotronHForCausalLM with mixture-of-experts blocks (\"E\": Nemotron 3) is not supported "
                         "yet; its dense forms (Nemotron-H, Nemotron Nano 2) are")
    return kinds


class NemotronHBlock(nn.Module):
    def __init__(self, config: ArchConfig, kind: str, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.kind = kind
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if kind == "mamba":
            self.mixer = MambaMixer(c.hidden_size, c.mamba, dtype)
        elif kind == "attention":
            self.mixer = SelfAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, backend, dtype,
                                       scale=c.attn_scale, use_rope=False, qkv_bias=c.qkv_bias, o_bias=c.o_bias)
        else:
            self.mixer = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype, bias=False)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                cache: Any, meta: AttentionMetadata, steps: StateSteps | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        if self.kind == "mamba":
            return self.mixer(hidden, cache, steps), residual
        if self.kind == "attention":
            return self.mixer(hidden, cos, sin, cache, meta), residual
        return self.mixer(hidden), residual


def _nemotron_map() -> TensorMap:
    out: TensorMap = {
        "backbone.embeddings.weight": ("embed_tokens.weight", None),
        "model.embeddings.weight": ("embed_tokens.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
    }
    for root in ("backbone", "model"):             # the hub's prefix, and transformers 5's
        out[f"{root}.norm_f.weight"] = ("norm_f.weight", None)
        out[f"{root}.layers.{{i}}.norm.weight"] = ("layers.{i}.norm.weight", None)
        for name in MAMBA2_MIXER + ("up_proj.weight", "up_proj.bias", "down_proj.weight", "down_proj.bias",
                                    "o_proj.weight", "o_proj.bias"):
            out[f"{root}.layers.{{i}}.mixer.{name}"] = (f"layers.{{i}}.mixer.{name}", None)
        for s in "qkv":
            for p in ("weight", "bias"):
                out[f"{root}.layers.{{i}}.mixer.{s}_proj.{p}"] = (f"layers.{{i}}.mixer.qkv_proj.{p}", s)
    return out


class NemotronHForCausalLM(CausalLM):
    hf_tensor_map: ClassVar[TensorMap] = _nemotron_map()
    gguf_tensor_map: ClassVar[TensorMap] = {}
    hf_defaults: ClassVar[dict[str, Any]] = {"mlp_hidden_act": "relu2", "use_bias": False,
                                             "use_conv_bias": True, "conv_kernel": 4, "n_groups": 1,
                                             "layer_norm_epsilon": 1e-5, "attention_bias": False}

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        kinds = block_kinds(raw)
        if isinstance(raw.get("intermediate_size"), list):
            raise ValueError("NemotronHForCausalLM with a different MLP width per block is not supported")
        return {**raw, "num_hidden_layers": len(kinds), "rms_norm_eps": raw["layer_norm_epsilon"]}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        kinds = block_kinds(raw)
        d_inner = raw["mamba_num_heads"] * raw["mamba_head_dim"]
        dims = mamba2_dims({**raw, "mamba_n_heads": raw["mamba_num_heads"], "mamba_d_head": raw["mamba_head_dim"],
                            "mamba_d_state": raw["ssm_state_size"], "mamba_d_conv": raw["conv_kernel"],
                            "mamba_proj_bias": raw["use_bias"], "time_step_limit": None}, d_inner)
        return {"mamba": dims, "mamba_layers": tuple(i for i, k in enumerate(kinds) if k == "mamba"),
                "mixerless_layers": tuple(i for i, k in enumerate(kinds) if k == "mlp"),
                "hidden_act": hf_activation(raw["mlp_hidden_act"], "NemotronHForCausalLM"),
                "rope_layers": (False,) * len(kinds)}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = self.config = config
        kinds = ["mamba" if c.is_mamba_layer(i) else "mlp" if i in c.mixerless_layers else "attention"
                 for i in range(c.num_layers)]
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.layers = nn.ModuleList(NemotronHBlock(c, k, attn_backend, dtype) for k in kinds)
        self.start_layer, self.end_layer = 0, c.num_layers
        self.norm_f = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        tied = self.embed_tokens.weight if c.tie_word_embeddings else None
        self.lm_head = Linear(c.hidden_size, c.vocab_size, dtype, weight=tied)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Any],
                meta: AttentionMetadata, intermediate: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # kv_caches[l]: a Mamba block's states, an attention block's KV cache, None for an MLP block
        steps = StateSteps.of(meta) if self.config.mamba is not None else None
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        empty = hidden.new_empty(0)                 # no rotary: attention blocks take no positions
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, empty, empty, cache, meta, steps)
        return self.norm_f(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
