"""Qwen3: Llama with a per-head RMSNorm of q and k before rotary, no q/k/v bias by default, and
Qwen2's sliding-window rule; its GGUF, like Qwen2's, keeps q/k rows as they are. Qwen3-VL's
checkpoints serve their language model."""
from __future__ import annotations

from typing import Any, ClassVar

from models.base import QWEN_VISION_PREFIXES, TensorMap, language_model_tensor_map
from models.llama import LlamaForCausalLM
from models.qwen2 import qwen_sliding_fields


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm: ClassVar[bool] = True
    hf_defaults: ClassVar[dict[str, Any]] = {"head_dim": 128}
    gguf_architectures: ClassVar[tuple[str, ...]] = ("qwen3",)
    gguf_permuted_qk: ClassVar[bool] = False

    gguf_tensor_map: ClassVar[TensorMap] = {
        **LlamaForCausalLM.gguf_tensor_map,
        "blk.{i}.attn_q_norm.weight": ("layers.{i}.self_attn.q_norm.weight", None),
        "blk.{i}.attn_k_norm.weight": ("layers.{i}.self_attn.k_norm.weight", None),
    }
    hf_tensor_map: ClassVar[TensorMap] = {
        **LlamaForCausalLM.hf_tensor_map,
        "model.layers.{i}.self_attn.q_norm.weight": ("layers.{i}.self_attn.q_norm.weight", None),
        "model.layers.{i}.self_attn.k_norm.weight": ("layers.{i}.self_attn.k_norm.weight", None),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return qwen_sliding_fields(raw, fields["num_layers"])


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    """Qwen3-VL's checkpoints: the language model, served on text (vLLM's --language-model-only),
    its interleaved M-RoPE plain rope for text, the vision tower (and the DeepStack features it
    adds to early layers, with images only) never read."""
    hf_text_config: ClassVar[str | None] = "text_config"
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = QWEN_VISION_PREFIXES
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_tensor_map: ClassVar[TensorMap] = {**Qwen3ForCausalLM.hf_tensor_map,
                                          **language_model_tensor_map(Qwen3ForCausalLM.hf_tensor_map)}

