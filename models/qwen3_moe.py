"""Qwen3-MoE: Qwen3 whose MLPs are mixtures of experts (models/moe.py), except the layers
``mlp_only_layers`` names and those ``decoder_sparse_step`` skips, which keep a dense MLP of
``intermediate_size``. config.json: num_experts (transformers 5 writes num_local_experts),
num_experts_per_tok, moe_intermediate_size, norm_topk_prob. Checkpoints hold each expert's
gate/up/down projections apart (or, as transformers 5 keeps them in memory, stacked); they are
stacked at load."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from kernels.attention.base import AttentionBackend
from models.base import TensorMap
from models.config import ArchConfig
from models.moe import FusedMoE
from models.qwen3 import Qwen3ForCausalLM


def num_experts(raw: dict[str, Any], key: str = "num_experts", other: str = "num_local_experts") -> int:
    """The routed experts per layer: ``key``, else ``other`` (transformers 5 writes Qwen3-MoE's
    num_experts as num_local_experts, Mixtral's own name)."""
    value = raw.get(key, raw.get(other))
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json needs {key} (or {other}) >= 1, got {value!r}")
    return value


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
        E, step, dense = num_experts(raw), raw["decoder_sparse_step"], set(raw["mlp_only_layers"] or ())
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be at least 1, got {step}")
        layers = tuple(i for i in range(fields["num_layers"]) if i not in dense and (i + 1) % step == 0)
        return {**super().hf_fields(raw, fields), "num_experts": E, "num_experts_per_tok": raw["num_experts_per_tok"],
                "moe_intermediate_size": raw["moe_intermediate_size"], "norm_topk_prob": bool(raw["norm_topk_prob"]),
                "moe_layers": layers}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        use_moe_layers(self, config, dtype)
