"""GLM (``GlmForCausalLM``: GLM-4-9B's "hf" checkpoints) and GLM-4 (``Glm4ForCausalLM``: the
GLM-4-0414 models): Llama's layers with q/k/v biases (none on the output projection), gate|up in
one tensor, and a rotary over the first half of each head (``partial_rotary_factor`` 0.5) that
turns interleaved pairs of dimensions (0 with 1, 2 with 3, ...). The kernels turn half-split
pairs (i with i + d/2), so q's and k's rows are put in that order at load: each head's rotary
rows evens first, then odds (the attention scores are unchanged, as q and k move together; a
LoRA adapter's B rows are reordered the same way). GLM-4 adds a norm after attention and one
after the MLP, each before its residual add."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import TensorMap
from models.config import ArchConfig
from models.layers import RMSNorm
from models.llama import LlamaDecoderLayer, LlamaForCausalLM


def interleaved_to_half_split(rows: torch.Tensor, head_size: int, rotary_dim: int) -> torch.Tensor:
    """``rows`` (heads * head_size, ...) with each head's first ``rotary_dim`` rows reordered from
    interleaved rotary pairs to half-split ones: even rows, then odd rows, then the rest."""
    order = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                       torch.arange(rotary_dim, head_size)])
    heads = rows.shape[0] // head_size
    index = (torch.arange(heads)[:, None] * head_size + order[None]).reshape(-1)
    return rows[index]


class InterleavedRotary:
    """A model whose rotary turns interleaved pairs: q's and k's checkpoint rows (and a LoRA
    adapter's B rows for them) reordered to the kernels' half-split pairs at load."""

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        c = self.config
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                          "self_attn.k_proj.bias")):
            return interleaved_to_half_split(tensor, c.head_size, c.rotary_dim or c.head_size)
        return tensor


class GlmForCausalLM(InterleavedRotary, LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_defaults: ClassVar[dict[str, Any]] = {"partial_rotary_factor": 0.5, "attention_bias": True,
                                             "rms_norm_eps": 1.5625e-07}
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: v for k, v in LlamaForCausalLM.hf_tensor_map.items() if ".mlp.gate_proj" not in k and ".mlp.up_proj" not in k},
        "model.layers.{i}.mlp.gate_up_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", None),   # gate, then up
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {"o_bias": False}             # attention_bias is q's, k's and v's


class Glm4DecoderLayer(LlamaDecoderLayer):
    """GLM-4's layer: norm, attention, norm, residual add; norm, MLP, norm, residual add. Carried as
    Llama's (``hidden`` + ``residual`` is the stream entering it), so the next layer's, or the final,
    norm adds the last MLP output."""

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 qk_norm: bool = False, qk_norm_whole: bool = False) -> None:
        super().__init__(config, layer, backend, dtype, qk_norm, qk_norm_whole)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else hidden + residual
        stream = stream + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(stream), cos, sin,
                                                                       kv_cache, meta))
        return self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(stream))), stream


class Glm4ForCausalLM(GlmForCausalLM):
    decoder_layer: ClassVar[type[nn.Module]] = Glm4DecoderLayer
    hf_tensor_map: ClassVar[TensorMap] = {
        **GlmForCausalLM.hf_tensor_map,
        **{f"model.layers.{{i}}.{n}.weight": (f"layers.{{i}}.{n}.weight", None)
           for n in ("post_self_attn_layernorm", "post_mlp_layernorm")},
    }
