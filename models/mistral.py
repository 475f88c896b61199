"""Mistral: Llama whose layers may all use one sliding window (``config.sliding_window``);
the tensor names are Llama's, and llama.cpp converts it as a "llama" GGUF. Mistral 3's
multimodal checkpoints serve their language model."""
from __future__ import annotations

from typing import Any, ClassVar

from models.base import VISION_PREFIXES, TensorMap, language_model_tensor_map
from models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {"sliding_window": 4096}
    gguf_architectures: ClassVar[tuple[str, ...]] = ()   # its GGUF says "llama": read as Llama

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """One window for every layer (null: none); transformers ignores layer_types."""
        return {"sliding_window": raw["sliding_window"]}


class Mistral3ForConditionalGeneration(MistralForCausalLM):
    """Mistral Small 3.1 and 3.2 as published (a Pixtral vision tower beside the language model):
    the language model, served on text (vLLM's --language-model-only); the vision tensors are
    never read."""
    hf_text_config: ClassVar[str | None] = "text_config"
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = VISION_PREFIXES
    hf_tensor_map: ClassVar[TensorMap] = language_model_tensor_map(LlamaForCausalLM.hf_tensor_map)
