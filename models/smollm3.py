"""SmolLM3: Llama whose every fourth layer has no position encoding (NoPE: q and k are not
turned; ``no_rope_layers`` holds 1 for the layers that rotate), with Qwen2-style optional sliding
windows on the NoPE layers; llama.cpp converts it as a "smollm3" GGUF (q/k rows permuted as
Llama's) and hard-codes the interval of 4."""
from __future__ import annotations

from typing import Any, ClassVar

from models.config import FULL, SLIDING
from models.gguf_loader import GGUFArchKeys
from models.llama import LlamaForCausalLM

NO_ROPE_INTERVAL = 4     # transformers' default, and llama.cpp's fixed value


class SmolLM3ForCausalLM(LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ("smollm3",)
    hf_defaults: ClassVar[dict[str, Any]] = {"rope_theta": 2_000_000.0, "tie_word_embeddings": True}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        n = fields["num_layers"]
        rope = raw.get("no_rope_layers") or _rope_layers(n, int(raw.get("no_rope_layer_interval") or NO_ROPE_INTERVAL))
        rope = tuple(bool(r) for r in rope)
        if not (raw.get("use_sliding_window") and raw.get("sliding_window")):
            return {"rope_layers": rope, "sliding_window": None}
        types = raw.get("layer_types") or [FULL if r else SLIDING for r in rope]
        return {"rope_layers": rope, "sliding_window": raw["sliding_window"], "layer_types": tuple(types)}

    @classmethod
    def gguf_fields(cls, keys: GGUFArchKeys, fields: dict[str, Any]) -> dict[str, Any]:
        return {"rope_layers": tuple(_rope_layers(fields["num_layers"], NO_ROPE_INTERVAL))}


def _rope_layers(num_layers: int, interval: int) -> list[bool]:
    return [(i + 1) % interval != 0 for i in range(num_layers)]
