"""Qwen3-MoE: Qwen3 whose MLPs are mixtures of experts (models/moe.py), except the layers
``mlp_only_layers`` names and those ``decoder_sparse_step`` skips, which keep a dense MLP of
``intermediate_size``. config.json: num_experts (transformers 5 writes num_local_experts),
num_experts_per_tok, moe_intermediate_size, norm_topk_prob. Checkpoints hold each expert's
gate/up/down projections apart (or, as transformers 5 keeps them in memory, stacked); they are
stacked at load. Qwen2-MoE: Qwen2's attention, the same experts, and a gated shared expert."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from kernels.attention.base import AttentionBackend
from models.base import TensorMap
from models.config import ArchConfig
from models.layers import GatedMLP, Linear
from models.moe import FusedMoE, SharedExpertMoE
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM


def num_experts(raw: dict[str, Any], key: str = "num_experts", other: str = "num_local_experts") -> int:
    """The routed experts per layer: ``key``, else ``other`` (transformers 5 writes Qwen3-MoE's
    num_experts as num_local_experts, Mixtral's own name)."""
    value = raw.get(key, raw.get(other))
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json needs {key} (or {other}) >= 1, got {value!r}")
    return value


def qwen_moe_fields(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen's MoE keys: the experts, and the layers that have them: every ``decoder_sparse_step``-th
    but those ``mlp_only_layers`` names."""
    E, step, dense = num_experts(raw), raw["decoder_sparse_step"], set(raw["mlp_only_layers"] or ())
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1, got {step}")
    layers = tuple(i for i in range(fields["num_layers"]) if i not in dense and (i + 1) % step == 0)
    return {"num_experts": E, "num_experts_per_tok": raw["num_experts_per_tok"],
            "moe_intermediate_size": raw["moe_intermediate_size"], "norm_topk_prob": bool(raw["norm_topk_prob"]),
            "moe_layers": layers}


def use_moe_layers(model: torch.nn.Module, config: ArchConfig, dtype: torch.dtype) -> None:
    """Replace the dense MLP of every MoE layer of a Llama-built ``model`` by the experts."""
    for i, layer in enumerate(model.layers):
        if config.is_moe_layer(i):
            layer.mlp = FusedMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                 config.moe_intermediate_size, config.norm_topk_prob, dtype, config.hidden_act)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {**Qwen3ForCausalLM.hf_defaults, "decoder_sparse_step": 1,
                                             "mlp_only_layers": [], "norm_topk_prob": False}
    gguf_architectures: ClassVar[tuple[str, ...]] = ()    # its GGUF form is not read

    hf_tensor_map: ClassVar[TensorMap] = {
        **Qwen3ForCausalLM.hf_tensor_map,
        "model.layers.{i}.mlp.gate.weight": ("layers.{i}.mlp.gate.weight", None),
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": ("layers.{i}.mlp.w13_weight", "gate.{e}"),
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight": ("layers.{i}.mlp.w13_weight", "up.{e}"),
        "model.layers.{i}.mlp.experts.{e}.down_proj.weight": ("layers.{i}.mlp.w2_weight", "down.{e}"),
        "model.layers.{i}.mlp.experts.gate_up_proj": ("layers.{i}.mlp.w13_weight", None),   # stacked
        "model.layers.{i}.mlp.experts.down_proj": ("layers.{i}.mlp.w2_weight", None),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {**super().hf_fields(raw, fields), **qwen_moe_fields(raw, fields)}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        use_moe_layers(self, config, dtype)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen1.5-MoE and Qwen2-MoE: Qwen2's attention (q/k/v biases), Qwen3-MoE's placement of the
    experts, and beside them a shared expert of ``shared_expert_intermediate_size`` whose output
    a sigmoid gate (``shared_expert_gate``, hidden -> 1) scales."""
    hf_defaults: ClassVar[dict[str, Any]] = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
                                             "shared_expert_intermediate_size": 0}
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: (v[0].replace(".mlp.", ".mlp.moe."), v[1]) for k, v in Qwen3MoeForCausalLM.hf_tensor_map.items()
           if ".mlp.gate." in k or ".mlp.experts." in k},
        **{k: v for k, v in Qwen3MoeForCausalLM.hf_tensor_map.items() if not (".mlp.gate." in k or ".mlp.experts." in k)},
        **{f"model.layers.{{i}}.mlp.shared_expert.{p}_proj.weight":
           ("layers.{i}.mlp.shared_mlp." + ("down_proj.weight" if p == "down" else "gate_up_proj.weight"),
            None if p == "down" else p) for p in ("gate", "up", "down")},
        "model.layers.{i}.mlp.shared_expert_gate.weight": ("layers.{i}.mlp.shared_gate.weight", None),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {**super().hf_fields(raw, fields), **qwen_moe_fields(raw, fields),
                "shared_expert_intermediate_size": int(raw["shared_expert_intermediate_size"] or 0)}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        use_moe_layers(self, config, dtype)
        size = config.shared_expert_intermediate_size
        for i, layer in enumerate(self.layers):
            if config.is_moe_layer(i):
                shared = GatedMLP(config.hidden_size, size, config.hidden_act, dtype) if size else None
                layer.mlp = SharedExpertMoE(layer.mlp, shared, Linear(config.hidden_size, 1, dtype) if size else None)
