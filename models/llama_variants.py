"""Llama's layers under other names, each stated as its differences: Helium (kyutai: an
interleaved rotary, q/k/v biases with ``attention_bias`` and none on the output), ERNIE 4.5
(Baidu's dense models: an interleaved rotary), Seed-OSS (ByteDance: q/k/v biases, the output's by
``attention_out_bias``) and Ministral (Mistral with ``layer_types``: sliding layers beside global
ones). The interleaved rotaries are served as GLM's (models/glm.py): q's and k's rows reordered at
load."""
from __future__ import annotations

from typing import Any, ClassVar

from models.glm import InterleavedRotary
from models.llama import LlamaForCausalLM
from models.mistral import MistralForCausalLM


class HeliumForCausalLM(InterleavedRotary, LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {"o_bias": False}               # attention_bias is q's, k's and v's


class Ernie4_5ForCausalLM(InterleavedRotary, LlamaForCausalLM):      # noqa: N801 - transformers' name
    gguf_architectures: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("use_bias"):
            raise ValueError("Ernie4_5ForCausalLM with use_bias (biases on the MLP too) is not supported")
        return {"qkv_bias": False, "o_bias": False}


class SeedOssForCausalLM(LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {"qkv_bias": bool(raw.get("attention_bias", True)), "o_bias": bool(raw.get("attention_out_bias", False))}


class MinistralForCausalLM(MistralForCausalLM):
    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        types = raw.get("layer_types")
        window = raw.get("sliding_window")
        if not types or window is None:
            return {"sliding_window": window}
        return {"sliding_window": window, "layer_types": tuple(types)}
