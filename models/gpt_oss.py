"""gpt-oss (OpenAI's open-weight models, ``GptOssForCausalLM``): Llama's pre-norm layers with
biases on q, k, v and o, a learned attention sink per head (one more softmax term with no value:
kernels/attention/base.py), every other layer sliding (``layer_types``, a window of 128), YaRN
rope, and a mixture of experts in every MLP: a router with a bias, the top-k logits' softmax (the
renormalized top-k of the full softmax), experts with biases and the clamped "swigluoai"
activation (models/moe.py).

Checkpoints hold the experts stacked, as transformers does: ``gate_up_proj`` (E, H, 2I) with the
gate and up columns interleaved (gate, up, gate, ...), ``down_proj`` (E, I, H), or, as OpenAI
publishes them, in MXFP4 (``*_blocks`` and ``*_scales``, config.json's ``quant_method:
"mxfp4"``: models/quantization/mxfp4.py), dequantized here as they are read. Either way they
are turned into our stacked layout (gate rows, then up rows; (E, H, I) down)."""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch

from kernels.attention.base import AttentionBackend
from models.base import TensorMap
from models.config import FULL, SLIDING, ArchConfig
from models.llama import LlamaForCausalLM
from models.moe import FusedMoE
from models.quantization.mxfp4 import dequantize_mxfp4
from models.qwen3_moe import num_experts

_EXPERTS = "mlp.experts."


def _split_interleaved(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate, up, gate, up, ... along ``dim`` -> every gate, then every up."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


class GptOssForCausalLM(LlamaForCausalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {"rms_norm_eps": 1e-5, "sliding_window": 128, "attention_bias": True,
                                             "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rope_theta": 150000.0,
                                             "num_experts_per_tok": 4, "head_dim": 64}
    gguf_architectures: ClassVar[tuple[str, ...]] = ()    # its GGUF form is not read
    gguf_permuted_qk: ClassVar[bool] = False
    reads_mxfp4: ClassVar[bool] = True                    # models/quantization/mxfp4.py
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: v for k, v in LlamaForCausalLM.hf_tensor_map.items() if ".mlp." not in k},
        "model.layers.{i}.self_attn.sinks": ("layers.{i}.self_attn.sinks", None),
        "model.layers.{i}.mlp.router.weight": ("layers.{i}.mlp.gate.weight", None),
        "model.layers.{i}.mlp.router.bias": ("layers.{i}.mlp.gate.bias", None),
        # stacked in our layout by hf_weights
        "model.layers.{i}.mlp.experts.gate_up_proj": ("layers.{i}.mlp.w13_weight", None),
        "model.layers.{i}.mlp.experts.gate_up_proj_bias": ("layers.{i}.mlp.w13_bias", None),
        "model.layers.{i}.mlp.experts.down_proj": ("layers.{i}.mlp.w2_weight", None),
        "model.layers.{i}.mlp.experts.down_proj_bias": ("layers.{i}.mlp.w2_bias", None),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        n = fields["num_layers"]
        types = tuple(raw.get("layer_types") or (SLIDING if i % 2 == 0 else FULL for i in range(n)))
        if raw.get("swiglu_limit") is None:
            raise ValueError("gpt-oss's config.json needs swiglu_limit (its experts' clamp)")
        return {"num_experts": num_experts(raw, "num_local_experts", "num_experts"),
                "num_experts_per_tok": raw["num_experts_per_tok"], "moe_intermediate_size": fields["intermediate_size"],
                "norm_topk_prob": True, "moe_layers": tuple(range(n)), "moe_bias": True,
                "swiglu_limit": float(raw["swiglu_limit"]), "swiglu_alpha": float(raw["swiglu_alpha"]),
                "sliding_window": raw.get("sliding_window"), "layer_types": types, "attention_sinks": True}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        c = config
        for layer in self.layers:
            layer.mlp = FusedMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                                 True, dtype, "swigluoai", bias=True, swiglu_alpha=c.swiglu_alpha,
                                 swiglu_limit=c.swiglu_limit)

    def hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The experts' tensors in our layout; an MXFP4 pair (``X_blocks``, ``X_scales``, in
        either order) dequantized into ``X`` once both are read."""
        pending: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if _EXPERTS not in name:
                yield name, tensor
                continue
            if name.endswith(("_blocks", "_scales")):
                base, _, part = name.rpartition("_")
                other = pending.pop(f"{base}_{'scales' if part == 'blocks' else 'blocks'}", None)
                if other is None:
                    pending[name] = tensor
                    continue
                blocks, scales = (tensor, other) if part == "blocks" else (other, tensor)
                # (E, rows, G, 16) -> (E, rows, G * 32): the rows are already the out-features
                w = dequantize_mxfp4(blocks, scales)
                yield base, _split_interleaved(w, 1) if base.endswith("gate_up_proj") else w
                continue
            if name.endswith("gate_up_proj"):                 # (E, H, 2I) interleaved -> (E, 2I, H)
                yield name, _split_interleaved(tensor.transpose(1, 2), 1)
            elif name.endswith("gate_up_proj_bias"):          # (E, 2I) interleaved
                yield name, _split_interleaved(tensor, 1)
            elif name.endswith("down_proj"):                  # (E, I, H) -> (E, H, I)
                yield name, tensor.transpose(1, 2)
            else:
                yield name, tensor
        if pending:
            raise ValueError(f"MXFP4 tensors without their other half (blocks or scales): {sorted(pending)}")
