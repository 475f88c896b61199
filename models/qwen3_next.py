"""Qwen3-Next: Gated DeltaNet linear attention in three layers of four, gated full attention in
the fourth, (1 + weight) RMSNorms, and Qwen2-MoE's experts with a gated shared expert.

Gated DeltaNet (``GatedDeltaNet``), per value head h with its state S (d_k, d_v) carried in the
request's state slot beside its convolution's last inputs (models/mamba.py's slots, MambaDims
version 3): q, k, v convolved causally (SiLU), q and k L2-normalized (q also scaled by d_k ** -0.5,
each query/key head serving num_v_heads / num_k_heads value heads), then for each token
    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q
with the decay g = -exp(A_log) softplus(a + dt_bias) and the write strength beta = sigmoid(b),
and o through an RMSNorm gated by silu(z) per head.

The checkpoint's in_proj_qkvz and in_proj_ba rows are grouped by key head; they are read into
one projection of q | k | v | z | b | a (Qwen3.5's separate in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a in that order). Its norms scale by 1 + weight (Gemma's), in float32, rounded once.
"""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from models.base import QWEN_VISION_PREFIXES, TensorMap, language_model_tensor_map
from models.config import ArchConfig, MambaDims
from kernels.attention.base import AttentionBackend
from kernels.cpu import ssm
from kernels.triton import fused as triton_fused
from models.layers import GemmaRMSNorm, Linear, MergedLinear, RMSNorm
from models.mamba import CausalConv1d, HybridDecoderLayer, StateSteps, hybrid_mamba_layers
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3_moe import Qwen2MoeForCausalLM


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     S: torch.Tensor) -> torch.Tensor:
    """One request's tokens, float32: q, k (n, H, d_k), v (n, H, d_v), g, beta (n, H); ``S`` (H, d_k,
    d_v) the state before them, updated in place. Returns o (n, H, d_v)."""
    out = torch.empty_like(v)
    state = S
    decay = torch.exp(g)
    for t in range(q.shape[0]):
        state = state * decay[t][:, None, None]
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], state)) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], state)
    S.copy_(state)
    return out


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer of Qwen3-Next and Qwen3.5 over the request's recurrent state:
    ``state`` (conv_state, recurrent_state), the engine's slots of this layer."""

    def __init__(self, hidden_size: int, dims: MambaDims, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.dims = dims
        self.key_dim, self.value_dim = d.n_groups * d.d_state, d.d_inner
        self.in_proj = MergedLinear(hidden_size, {"qkv": 2 * self.key_dim + self.value_dim, "z": self.value_dim,
                                                  "b": d.num_heads, "a": d.num_heads}, dtype)
        self.conv1d = CausalConv1d(d.conv_dim, d.d_conv, False, dtype)
        self.dt_bias = nn.Parameter(torch.empty(d.num_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(d.num_heads, dtype=dtype), requires_grad=False)
        self.norm = RMSNorm(d.head_dim, eps, dtype)            # per value head, then gated by silu(z)
        self.out_proj = Linear(self.value_dim, hidden_size, dtype)

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], steps: StateSteps
                ) -> torch.Tensor:
        d, T = self.dims, hidden.shape[0]
        conv_state, S = state
        qkv, z, b, a = self.in_proj(hidden).split([2 * self.key_dim + self.value_dim, self.value_dim,
                                                   d.num_heads, d.num_heads], -1)
        qkv = self.conv1d(qkv, conv_state, steps).float()
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        rep = d.num_heads // d.n_groups
        q = l2norm(q.reshape(T, d.n_groups, d.d_state)).repeat_interleave(rep, 1) * d.d_state ** -0.5
        k = l2norm(k.reshape(T, d.n_groups, d.d_state)).repeat_interleave(rep, 1)
        v = v.reshape(T, d.num_heads, d.head_dim)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        o = self._recurrence(q, k, v, g, beta, S, steps).to(hidden.dtype)        # (T, H, d_v)
        o = self.norm(o.reshape(T * d.num_heads, d.head_dim)).float() * F.silu(z.float().reshape(-1, d.head_dim))
        return self.out_proj(o.to(hidden.dtype).reshape(T, self.value_dim))

    def _recurrence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    S: torch.Tensor, steps: StateSteps) -> torch.Tensor:
        """The delta rule over the step's requests: by a kernel (kernels/cpu/ssm.c on the CPU,
        kernels/triton/ssm.py on GPUs) where one takes these tensors, else this torch reference."""
        args = (S, steps.slot_index, steps.fresh_mask, steps.qsl, q, k, v, g, beta)
        if ssm.supports(S, q, k, v, g, beta) and v.shape[-1] <= ssm.MAX_VALUE_DIM:
            return ssm.gdn_scan(*args)
        if triton_fused.supports(S, q, k, v, g, beta):
            from kernels.triton.ssm import gdn_scan as triton_gdn_scan
            return triton_gdn_scan(*args)
        if steps.decode:
            n = steps.slot_index.numel()
            h = steps.gather(S)                                           # (B, H, d_k, d_v)
            q, k, v, g, beta = q[:n], k[:n], v[:n], g[:n], beta[:n]
            h = h * torch.exp(g)[:, :, None, None]
            delta = (v - torch.einsum("bhk,bhkv->bhv", k, h)) * beta[:, :, None]
            h = h + k[:, :, :, None] * delta[:, :, None, :]
            S[steps.slot_index] = h
            out = torch.einsum("bhk,bhkv->bhv", q, h)
            return torch.cat([out, v.new_zeros(q.shape[0] - n, *out.shape[1:])]) if q.shape[0] > n else out
        return steps.each_request(S, torch.zeros_like(v),
                                  lambda s, h: gated_delta_rule(q[s], k[s], v[s], g[s], beta[s], h))


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    """Llama's layer with a Gated DeltaNet in the linear-attention layers."""

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 qk_norm: bool = False, qk_norm_whole: bool = False) -> None:
        super().__init__(config, layer, backend, dtype, qk_norm, qk_norm_whole)
        c = config          # (1 + weight) norms, in float32 and rounded once, as the checkpoint's
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if self.mamba is None:
            self.self_attn.q_norm = GemmaRMSNorm(c.head_size, c.rms_norm_eps, dtype)
            self.self_attn.k_norm = GemmaRMSNorm(c.head_size, c.rms_norm_eps, dtype)

    def make_mixer(self, config: ArchConfig, dtype: torch.dtype) -> nn.Module:
        return GatedDeltaNet(config.hidden_size, config.mamba, config.rms_norm_eps, dtype)


def linear_attention_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's and Qwen3.5's: the Gated DeltaNet layers (``layer_types``) and their
    dimensions, the gated attention of the others."""
    layers = hybrid_mamba_layers(raw)
    dims = MambaDims(3, raw["linear_num_value_heads"] * raw["linear_value_head_dim"], raw["linear_key_head_dim"],
                     raw["linear_conv_kernel_dim"], num_heads=raw["linear_num_value_heads"],
                     head_dim=raw["linear_value_head_dim"], n_groups=raw["linear_num_key_heads"], conv_bias=False)
    return {"qkv_bias": bool(raw.get("attention_bias", False)), "attn_output_gate": True,
            "mamba": dims if layers else None, "mamba_layers": layers or None}


class Qwen3NextForCausalLM(Qwen2MoeForCausalLM):
    qk_norm: ClassVar[bool] = True
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = ("mtp.",)     # its multi-token-prediction layer: not run
    decoder_layer: ClassVar[type[nn.Module]] = Qwen3NextDecoderLayer
    hf_defaults: ClassVar[dict[str, Any]] = {**Qwen2MoeForCausalLM.hf_defaults, "norm_topk_prob": True,
                                             "linear_conv_kernel_dim": 4}
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: v for k, v in Qwen2MoeForCausalLM.hf_tensor_map.items() if ".self_attn.q_proj." not in k},
        "model.layers.{i}.self_attn.q_proj.weight": ("layers.{i}.self_attn.qkv_proj.weight", "q"),
        "model.layers.{i}.self_attn.gate_proj.weight": ("layers.{i}.self_attn.qkv_proj.weight", "gate"),
        "model.layers.{i}.self_attn.q_norm.weight": ("layers.{i}.self_attn.q_norm.weight", None),
        "model.layers.{i}.self_attn.k_norm.weight": ("layers.{i}.self_attn.k_norm.weight", None),
        **{f"model.layers.{{i}}.linear_attn.in_proj_{part}.weight": ("layers.{i}.mamba.in_proj.weight", part)
           for part in ("qkv", "z", "b", "a")},
        **{f"model.layers.{{i}}.linear_attn.{name}": (f"layers.{{i}}.mamba.{name}", None)
           for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")},
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {**super().hf_fields(raw, fields), **linear_attention_fields(raw)}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Qwen3-Next's grouped projections into Qwen3.5's separate ones, q_proj's per-head q | gate
        rows into q and gate."""
        c = self.config
        for name, tensor in weights:
            if name.endswith("linear_attn.in_proj_qkvz.weight"):
                yield from self._split_qkvz(name.removesuffix("in_proj_qkvz.weight"), tensor)
            elif name.endswith("linear_attn.in_proj_ba.weight"):
                d = c.mamba
                ba = tensor.view(d.n_groups, 2, d.num_heads // d.n_groups, -1)
                prefix = name.removesuffix("in_proj_ba.weight")
                yield prefix + "in_proj_b.weight", ba[:, 0].reshape(d.num_heads, -1)
                yield prefix + "in_proj_a.weight", ba[:, 1].reshape(d.num_heads, -1)
            elif name.endswith("self_attn.q_proj.weight") and c.attn_output_gate:
                qg = tensor.view(c.num_heads, 2, c.head_size, -1)
                yield name, qg[:, 0].reshape(c.num_heads * c.head_size, -1)
                yield name.replace("q_proj", "gate_proj"), qg[:, 1].reshape(c.num_heads * c.head_size, -1)
            else:
                yield name, self.hf_rows(name, tensor)

    def _split_qkvz(self, prefix: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """in_proj_qkvz rows, per key head g: q_g (d_k), k_g (d_k), v of its value heads, z of them."""
        d = self.config.mamba
        dk, dv, r = d.d_state, d.head_dim, d.num_heads // d.n_groups
        grouped = tensor.view(d.n_groups, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], 1)
        yield prefix + "in_proj_qkv.weight", torch.cat([x.reshape(-1, tensor.shape[-1]) for x in (q, k, v)])
        yield prefix + "in_proj_z.weight", z.reshape(-1, tensor.shape[-1])


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's mixture-of-experts models (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): Qwen3-Next's
    layers with Qwen3.5's separate Gated DeltaNet projections, experts in every layer."""
    hf_defaults: ClassVar[dict[str, Any]] = {**Qwen3NextForCausalLM.hf_defaults, "decoder_sparse_step": 1,
                                             "mlp_only_layers": []}

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {"intermediate_size": raw.get("moe_intermediate_size"), **raw}


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's dense models (Qwen3.5-0.8B to 27B): Qwen3-Next's layers with a dense MLP."""

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {**Qwen2ForCausalLM.hf_fields(raw, fields), **linear_attention_fields(raw)}


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """Qwen3.5's published checkpoints: the language model, served on text (vLLM's
    --language-model-only), its interleaved M-RoPE plain rope for text, the vision tower never read."""
    hf_text_config: ClassVar[str | None] = "text_config"
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = QWEN_VISION_PREFIXES + ("mtp.",)
    hf_tensor_map: ClassVar[TensorMap] = {**Qwen3NextForCausalLM.hf_tensor_map,
                                          **language_model_tensor_map(Qwen3NextForCausalLM.hf_tensor_map)}


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    hf_text_config: ClassVar[str | None] = "text_config"
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = QWEN_VISION_PREFIXES + ("mtp.",)
    hf_tensor_map: ClassVar[TensorMap] = Qwen3_5ForConditionalGeneration.hf_tensor_map
