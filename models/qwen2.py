"""Qwen2: Llama with biases on the q/k/v projections, always, and optional sliding-window layers
(``layer_types``); the tensor names are Llama's. llama.cpp runs it with NeoX rotary, so its
GGUF keeps q/k rows as they are."""
from __future__ import annotations

from typing import Any, ClassVar

from models.config import FULL, SLIDING
from models.llama import LlamaForCausalLM


def qwen_sliding_fields(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen2's and Qwen3's rule: ``use_sliding_window`` turns the window on, for the layers
    ``layer_types`` marks, by default those from ``max_window_layers`` on."""
    if not raw.get("use_sliding_window", False):
        return {}
    types = raw.get("layer_types") or [SLIDING if i >= raw.get("max_window_layers", 28) else FULL
                                       for i in range(num_layers)]
    return {"sliding_window": raw.get("sliding_window"), "layer_types": tuple(types)}


class Qwen2ForCausalLM(LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ("qwen2",)
    gguf_permuted_qk: ClassVar[bool] = False

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {"qkv_bias": True, **qwen_sliding_fields(raw, fields["num_layers"])}
