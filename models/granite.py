"""Granite (IBM's Granite 3.x): Llama with four multipliers: the input embeddings scaled, each
sublayer's output scaled before the residual add, the attention's own scale in place of
1/sqrt(head_size), and the logits divided; llama.cpp converts it as a "granite" GGUF (q/k rows
permuted as Llama's) with the multipliers as header keys."""
from __future__ import annotations

from typing import Any, ClassVar

from models.gguf_loader import GGUFArchKeys
from models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ("granite",)

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return _multipliers(float(raw.get("embedding_multiplier", 1.0)), float(raw.get("residual_multiplier", 1.0)),
                            float(raw.get("attention_multiplier", 1.0)), float(raw.get("logits_scaling", 1.0)))

    @classmethod
    def gguf_fields(cls, keys: GGUFArchKeys, fields: dict[str, Any]) -> dict[str, Any]:
        return _multipliers(float(keys.get("embedding_scale", 1.0)), float(keys.get("residual_scale", 1.0)),
                            float(keys.require("attention.scale")), float(keys.get("logit_scale", 1.0)))


def _multipliers(embedding: float, residual: float, attention: float, logits: float) -> dict[str, Any]:
    if not attention > 0 or not logits:
        raise ValueError(f"Granite's attention_multiplier ({attention}) must be positive and its logits_scaling "
                         f"({logits}) non-zero")
    # the attention scale is query_pre_attn_scalar ** -0.5 (models/config.py)
    return dict(embedding_multiplier=embedding, residual_multiplier=residual, logits_scaling=logits,
                query_pre_attn_scalar=attention ** -2)
