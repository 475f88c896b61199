"""DeepSeek-V2 and V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``: DeepSeek-V2/V2.5,
V2-Lite, V3, R1, Kimi K2, Moonlight): Llama's pre-norm layers with multi-head latent attention
and, past the first ``first_k_dense_replace`` layers, a mixture of experts with shared experts.

Latent attention (MLA, ``MLAttention``): each token's keys and values come from one latent
c (``kv_lora_rank`` wide, RMS-normed) and a rotary key part k_pe (``qk_rope_head_dim``) shared by
every head; head h's key is [W_UK[h] c, k_pe], its value W_UV[h] c (W_UK and W_UV: the halves of
``kv_b_proj``), its query [q_nope, q_pe]. The cache holds only [c, k_pe] per token, as one
key/value head (the engine's ``head_size`` is its width): W_UK is absorbed into the query,
q' = [W_UK[h]^T q_nope, q_pe], so that q' . [c, k_pe] is the head's score, and the attention's
output over the latents, o' = sum_k p_k c_k, becomes the head's output W_UV[h] o'. The cache row
is stored as key and as value (twice the latent: vLLM's MLA backends store it once). The
attention scale is (qk_nope + qk_rope)^-0.5, times YaRN's mscale^2 (``mscale_all_dim``).

The rotary turns interleaved pairs (V2's complex form, V3's ``rope_interleave``): q's and k_pe's
rotary rows are put in the kernels' half-split order at load.

Routing (models/moe.py ``route``): V2's softmax scores, top-k greedy or within the best groups
by their best expert (``group_limited_greedy``); V3's sigmoid scores with a learned correction
bias to choose, within the best groups by their two best experts, renormalized; both times
``routed_scaling_factor``. ``n_shared_experts`` experts of ``moe_intermediate_size`` every token
goes through, as one gated MLP. Tensor parallelism splits the heads (each rank their query rows,
their share of ``kv_b_proj`` and of the output projection) and keeps the latent whole on every
rank."""
from __future__ import annotations

import math
from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import TensorMap
from models.config import ArchConfig, MLADims, Routing
from models.layers import AttentionLayer, GatedMLP, Linear, RMSNorm, SelfAttention, _empty_param, apply_rotary_qk
from models.llama import LlamaDecoderLayer, LlamaForCausalLM
from models.moe import FusedMoE, SharedExpertMoE
from models.qwen3_moe import Qwen3MoeForCausalLM
from models.rope import interleaved_to_half_split


class MLAttention(SelfAttention):
    """Multi-head latent attention over a latent KV cache (module docstring); a SelfAttention to
    the engine (its cache, scales and groups), with its own projections."""

    def __init__(self, config: ArchConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        AttentionLayer.__init__(self, backend)      # the cache binding; its projections are its own
        c, m = config, config.mla
        H = c.num_heads
        self.mla = m
        self.num_heads, self.num_kv_heads, self.head_size = H, 1, m.kv_lora_rank + m.qk_rope_head_dim
        self.rotary_dim, self.use_rope, self.bidirectional = m.qk_rope_head_dim, True, False
        self.scale, self.sliding_window, self.logits_soft_cap, self.sinks = c.attn_scale, None, None, None
        self.register_buffer("alibi_slopes", None, persistent=False)
        self.q_norm = self.k_norm = None
        self.qk_norm_whole = False
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, H * qk, dtype)
        else:
            self.q_a_proj = Linear(c.hidden_size, m.q_lora_rank, dtype, bias=c.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, c.rms_norm_eps, dtype)
            self.q_b_proj = Linear(m.q_lora_rank, H * qk, dtype)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim, dtype, bias=c.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, c.rms_norm_eps, dtype)
        # kv_b_proj's weight, read whole into the query's absorption and the output's expansion
        self.kv_b_weight = _empty_param(H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, dtype=dtype)
        self.o_proj = Linear(H * m.v_head_dim, c.hidden_size, dtype, bias=c.o_bias)
        self.q_size, self.kv_size = H * self.head_size, self.head_size
        self.custom_ops = True

    def shard_tensor_parallel(self, world: int, rank: int, group: Any) -> None:
        """This rank's run of heads: their query rows, their rows of ``kv_b_proj`` and the output
        projection's columns (summed over the ranks); the latent, its norm and the cache row
        whole on every rank (the one key/value head, replicated)."""
        from models.tensor_parallel import column_parallel, row_parallel
        from models.tp_layout import split
        m = self.mla
        start, count = split(self.num_heads, world, rank)
        qk, kv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_nope_head_dim + m.v_head_dim
        if m.q_lora_rank is None:
            self.q_proj = column_parallel(self.q_proj, [(start * qk, count * qk)])
        else:
            self.q_b_proj = column_parallel(self.q_b_proj, [(start * qk, count * qk)])
        self.kv_b_weight = nn.Parameter(self.kv_b_weight.data[start * kv:(start + count) * kv].clone(),
                                        requires_grad=False)
        self.o_proj = row_parallel(self.o_proj, (start * m.v_head_dim, count * m.v_head_dim), rank, group)
        self.num_heads, self.q_size = count, count * self.head_size

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, m, H = x.shape[0], self.mla, self.num_heads
        nope, rope, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, H, nope + rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())                         # (T, r)
        q_pe, k_pe = apply_rotary_qk(q[..., nope:].contiguous(), k_pe.contiguous().view(T, 1, rope), cos, sin,
                                     self.custom_ops)
        w = self.kv_b_weight.view(H, nope + m.v_head_dim, r)
        query = torch.cat([torch.einsum("thn,hnr->thr", q[..., :nope], w[:, :nope]), q_pe], dim=-1)  # (T, H, r + rope)
        key = torch.cat([latent, k_pe.view(T, rope)], dim=-1).view(T, 1, r + rope)
        out = self.attend(query, key, key, kv_cache, meta, self.scale, None)      # (T, H, r + rope)
        heads = torch.einsum("thr,hvr->thv", out[..., :r], w[:, nope:])            # (T, H, v)
        return self.o_proj(heads.reshape(T, H * m.v_head_dim))


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer order around latent attention and a dense MLP or the experts."""

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 qk_norm: bool = False, qk_norm_whole: bool = False) -> None:
        nn.Module.__init__(self)
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = MLAttention(c, backend, dtype)
        self.residual_multiplier = 1.0
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = deepseek_mlp(c, layer, dtype)


def deepseek_mlp(c: ArchConfig, layer: int, dtype: torch.dtype) -> nn.Module:
    """Layer ``layer``'s MLP: dense before ``first_k_dense_replace``, else the routed experts
    with the shared ones (GLM-4.5's too)."""
    if not c.is_moe_layer(layer):
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype)
    moe = FusedMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                   c.norm_topk_prob, dtype, c.hidden_act, routing=c.moe_routing)
    shared = (GatedMLP(c.hidden_size, c.shared_expert_intermediate_size, c.hidden_act, dtype)
              if c.shared_expert_intermediate_size else None)
    return SharedExpertMoE(moe, shared)


def deepseek_moe_fields(raw: dict[str, Any], num_layers: int, method: str, sigmoid: bool) -> dict[str, Any]:
    """The experts' ArchConfig fields from DeepSeek's keys (n_routed_experts, n_shared_experts,
    first_k_dense_replace, moe_layer_freq, n_group, topk_group, routed_scaling_factor,
    norm_topk_prob) for its ``method`` of choosing (greedy, group_limited_greedy, noaux_tc)."""
    E = raw["n_routed_experts"] or 0
    first, freq = raw["first_k_dense_replace"] or 0, raw["moe_layer_freq"] or 1
    grouped = method != "greedy" and (raw["n_group"] or 1) > 1
    routing = Routing("sigmoid" if sigmoid else "softmax", raw["n_group"] if grouped else 0,
                      raw["topk_group"] if grouped else 0, "top2" if method == "noaux_tc" else "max",
                      method == "noaux_tc", float(raw["routed_scaling_factor"]))
    return {"num_experts": E, "num_experts_per_tok": raw.get("num_experts_per_tok") or 0,
            "moe_intermediate_size": raw.get("moe_intermediate_size") or 0,
            "norm_topk_prob": bool(raw["norm_topk_prob"]),
            "moe_layers": tuple(i for i in range(num_layers) if E and i >= first and i % freq == 0),
            "shared_expert_intermediate_size": (raw.get("moe_intermediate_size") or 0) * (raw["n_shared_experts"] or 0),
            "moe_routing": routing}


def skip_layers_past(weights: Iterable[tuple[str, torch.Tensor]], num_layers: int
                     ) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less those of layers past the model's (DeepSeek-V3's and
    GLM-4.5's multi-token-prediction layers: not run)."""
    for name, tensor in weights:
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= num_layers:
            continue
        yield name, tensor


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _routed() -> TensorMap:
    """Qwen3-MoE's names of the routed experts (the hub's per expert, transformers 5's stacked),
    held under the shared-expert wrapper's ``moe``."""
    return {k: (v[0].replace(".mlp.", ".mlp.moe."), v[1]) for k, v in Qwen3MoeForCausalLM.hf_tensor_map.items()
            if ".mlp.experts." in k}


DEEPSEEK_MOE_MAP: TensorMap = {       # the router, the routed experts, the shared ones (GLM-4.5's names too)
    "model.layers.{i}.mlp.gate.weight": ("layers.{i}.mlp.moe.gate.weight", None),
    "model.layers.{i}.mlp.gate.e_score_correction_bias": ("layers.{i}.mlp.moe.e_score_correction_bias", None),
    **_routed(),
    **{f"model.layers.{{i}}.mlp.shared_experts.{p}_proj.weight":
       ("layers.{i}.mlp.shared_mlp." + ("down_proj.weight" if p == "down" else "gate_up_proj.weight"),
        None if p == "down" else p) for p in ("gate", "up", "down")},
}


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    decoder_layer: ClassVar[type[nn.Module]] = DeepseekV2DecoderLayer
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_defaults: ClassVar[dict[str, Any]] = {"q_lora_rank": None, "first_k_dense_replace": 0, "moe_layer_freq": 1,
                                             "n_shared_experts": None, "n_routed_experts": None, "topk_method": "greedy",
                                             "n_group": None, "topk_group": None, "routed_scaling_factor": 1.0,
                                             "norm_topk_prob": False, "scoring_func": "softmax",
                                             "attention_bias": False, "rope_interleave": True,
                                             "rms_norm_eps": 1e-6}
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: v for k, v in LlamaForCausalLM.hf_tensor_map.items() if ".self_attn." not in k},
        **{f"model.layers.{{i}}.self_attn.{name}.{p}": (f"layers.{{i}}.self_attn.{name}.{p}", None)
           for name in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                        "o_proj") for p in ("weight", "bias")},
        "model.layers.{i}.self_attn.kv_b_proj.weight": ("layers.{i}.self_attn.kv_b_weight", None),
        **DEEPSEEK_MOE_MAP,
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        n = fields["num_layers"]
        mla = MLADims(raw["q_lora_rank"], raw["kv_lora_rank"], raw["qk_nope_head_dim"], raw["qk_rope_head_dim"],
                      raw["v_head_dim"])
        scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
        rope = fields["rope_scaling"]
        if rope.rope_type != "default" and rope.mscale_all_dim:  # YaRN's softmax scale (DeepSeek's yarn_get_mscale)
            scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        method = raw["topk_method"]
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"DeepSeek's topk_method {method!r} is not supported; supported: greedy, "
                             "group_limited_greedy, noaux_tc")
        if raw["scoring_func"] not in ("softmax", "sigmoid"):
            raise ValueError(f"DeepSeek's scoring_func {raw['scoring_func']!r} is not supported; supported: "
                             "softmax, sigmoid")
        return {
            "num_kv_heads": 1, "head_size": mla.kv_lora_rank + mla.qk_rope_head_dim, "rotary_dim": mla.qk_rope_head_dim,
            "query_pre_attn_scalar": scale ** -2, "mla": mla, "rotary_interleaved": cls.interleaves(raw),
            **deepseek_moe_fields(raw, n, method, raw["scoring_func"] == "sigmoid")}

    @classmethod
    def interleaves(cls, raw: dict[str, Any]) -> bool:
        return True                           # V2's complex rotary turns interleaved pairs

    def hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name, self.hf_rows(name, tensor)) for name, tensor in skip_layers_past(weights, self.config.num_layers))

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rotary rows (q's per head, k_pe's) from interleaved pairs to the kernels' half-split."""
        m = self.config.mla
        if not self.config.rotary_interleaved:
            return tensor
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            heads = tensor.view(-1, qk, *tensor.shape[1:])
            rope = heads[:, m.qk_nope_head_dim:].reshape(-1, *tensor.shape[1:])
            rope = interleaved_to_half_split(rope, m.qk_rope_head_dim, m.qk_rope_head_dim)
            return torch.cat([heads[:, :m.qk_nope_head_dim],
                              rope.view(heads.shape[0], m.qk_rope_head_dim, *tensor.shape[1:])], dim=1).reshape(
                tensor.shape)
        if name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
            r = m.kv_lora_rank
            return torch.cat([tensor[:r], interleaved_to_half_split(tensor[r:], m.qk_rope_head_dim, m.qk_rope_head_dim)])
        return tensor


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3: sigmoid scores with a correction bias, groups by their two best experts (noaux_tc),
    ``rope_interleave`` (the default) or a half-split rotary."""
    hf_defaults: ClassVar[dict[str, Any]] = {**DeepseekV2ForCausalLM.hf_defaults, "topk_method": "noaux_tc",
                                             "scoring_func": "sigmoid", "n_group": 8, "topk_group": 4,
                                             "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                                             "first_k_dense_replace": 3}

    @classmethod
    def interleaves(cls, raw: dict[str, Any]) -> bool:
        return bool(raw["rope_interleave"])
