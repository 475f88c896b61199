"""CausalLM: what a model class declares to the registry and the checkpoint readers. The
defaults declare nothing particular (config.json read as Llama's, no GGUF form, no tensor
fixups); a class overrides only its differences."""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from models.config import ArchConfig
from models.gguf_loader import GGUFArchKeys, unpermute_rotary_rows

# Checkpoint tensor name -> (our parameter, shard of a fused parameter or None); "{i}" stands
# for the layer index. The loaders only look names up here.
TensorMap = dict[str, tuple[str, str | None]]
# (tensor-name suffix, what undoes llama.cpp's conversion of the tensors so named)
Fixups = list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]


class CausalLM(nn.Module):
    hf_tensor_map: ClassVar[TensorMap]
    gguf_tensor_map: ClassVar[TensorMap]
    # transformers' defaults for config.json keys this architecture's configs may omit
    hf_defaults: ClassVar[dict[str, Any]] = {}
    # general.architecture values of its GGUF form; () when we read none
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    # llama.cpp's converter permuted attn_q/attn_k rows (its interleaved, non-NeoX rotary)
    gguf_permuted_qk: ClassVar[bool] = False
    # token texts llama.cpp ends generation on beside eos (end-of-turn markers)
    gguf_eog_tokens: ClassVar[tuple[str, ...]] = ()
    # pipeline parallelism (models/pipeline_parallel.py): what a stage hands the next, each
    # (tokens, hidden); () when the forward takes no intermediate tensors (one stage only)
    intermediate_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """ArchConfig fields from config.json's architecture-specific keys (``raw``, defaults
        filled in), overriding the generic ``fields``. None here: no sliding window."""
        return {}

    @classmethod
    def gguf_fields(cls, keys: GGUFArchKeys, fields: dict[str, Any]) -> dict[str, Any]:
        """ArchConfig fields from the GGUF header's architecture keys or llama.cpp's hard-coded
        values, overriding the generic ``fields``. None here."""
        return {}

    @classmethod
    def gguf_row_fixups(cls, config: ArchConfig) -> Fixups:
        """Row reorderings llama.cpp's converter applied, undone; they act on whole rows, so
        they hold for dequantized tensors and raw quantized block rows alike."""
        if not cls.gguf_permuted_qk:
            return []
        if config.rotary_dim is not None:
            raise ValueError(f"{cls.__name__}: a GGUF file with a partial rotary ({config.rotary_dim} of "
                             f"{config.head_size} head dimensions) is not supported")
        return [(".attn_q.weight", lambda w: unpermute_rotary_rows(w, config.num_heads)),
                (".attn_k.weight", lambda w: unpermute_rotary_rows(w, config.num_kv_heads))]

    @classmethod
    def gguf_value_fixups(cls, config: ArchConfig) -> Fixups:
        """Changes of value llama.cpp's converter made, undone on dequantized float32 tensors
        (a tensor named here is never run from its quantized blocks). None here."""
        return []
