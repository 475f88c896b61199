"""Mistral: Llama whose layers may all use one sliding window (``config.sliding_window``);
the tensor names are Llama's, and llama.cpp converts it as a "llama" GGUF."""
from __future__ import annotations

from models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
