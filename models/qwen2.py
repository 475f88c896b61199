"""Qwen2: Llama with biases on the q/k/v projections (``config.qkv_bias``, set by the config
readers) and optional sliding-window layers (``layer_types``); the tensor names are Llama's."""
from __future__ import annotations

from models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
