"""Gemma 2: Gemma 3's layers without the q/k norms, every other layer sliding (the even ones),
one rotary base for all, and its scores capped in every attention (``attn_logit_softcapping``:
C * tanh(s / C), taken by the CPU backend's torch path) besides its final logits. llama.cpp's
"gemma2" GGUF keeps both caps in its header and hard-codes the rest."""
from __future__ import annotations

from typing import Any, ClassVar

from models.config import FULL, SLIDING
from models.gemma3 import Gemma3ForCausalLM
from models.gguf_loader import GGUFArchKeys


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {       # transformers' Gemma2Config defaults
        "vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True}
    gguf_architectures: ClassVar[tuple[str, ...]] = ("gemma2",)
    qk_norm: ClassVar[bool] = False

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        n = fields["num_layers"]
        types = raw.get("layer_types") or _layer_types(n)
        return dict(sliding_window=raw.get("sliding_window"), layer_types=tuple(types), rope_local_theta=None,
                    query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
                    hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")

    @classmethod
    def gguf_fields(cls, keys: GGUFArchKeys, fields: dict[str, Any]) -> dict[str, Any]:
        """What llama.cpp hard-codes for gemma2: the even layers slide; the 27B (46 layers) scales
        queries by hidden / heads, every other size by head_size."""
        n = fields["num_layers"]
        scalar = fields["hidden_size"] // fields["num_heads"] if n == 46 else fields["head_size"]
        return dict(hidden_act="gelu_pytorch_tanh", sliding_window=keys.require("attention.sliding_window"),
                    layer_types=_layer_types(n), query_pre_attn_scalar=float(scalar),
                    attn_logit_softcapping=keys.get("attn_logit_softcapping"),
                    final_logit_softcapping=keys.get("final_logit_softcapping"))


def _layer_types(num_layers: int) -> tuple[str, ...]:
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
