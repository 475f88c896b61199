"""Mistral: Llama whose layers may all use one sliding window (``config.sliding_window``);
the tensor names are Llama's, and llama.cpp converts it as a "llama" GGUF."""
from __future__ import annotations

from typing import Any, ClassVar

from models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {"sliding_window": 4096}
    gguf_architectures: ClassVar[tuple[str, ...]] = ()   # its GGUF says "llama": read as Llama

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """One window for every layer (null: none); transformers ignores layer_types."""
        return {"sliding_window": raw["sliding_window"]}
