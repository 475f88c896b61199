"""CausalLM: what a model class declares to the registry and the checkpoint readers. The
defaults declare nothing particular (config.json read as Llama's, no GGUF form, no tensor
fixups); a class overrides only its differences."""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable

import torch
from torch import nn

from models.config import ArchConfig
from models.gguf_loader import GGUFArchKeys, unpermute_rotary_rows

# Checkpoint tensor name -> (our parameter, shard of a fused parameter or None); "{i}" stands
# for the layer index. The loaders only look names up here.
TensorMap = dict[str, tuple[str, str | None]]
# (tensor-name suffix, what undoes llama.cpp's conversion of the tensors so named)
Fixups = list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]


# where transformers' multimodal checkpoints keep the vision side: older saves, then 5.x's
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
QWEN_VISION_PREFIXES = ("visual.", "model.visual.")      # Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's
# where they keep the audio side (Qwen2-Audio's audio tower and projector)
AUDIO_PREFIXES = ("audio_tower.", "multi_modal_projector.", "model.audio_tower.", "model.multi_modal_projector.")


def language_model_tensor_map(text_map: TensorMap) -> TensorMap:
    """A causal LM's config.json tensor names as a multimodal checkpoint holds its language
    model: transformers' older layout (``language_model.model.*``, ``language_model.lm_head.*``,
    the hub's files) and 5.x's (``model.language_model.*``, ``lm_head.*``)."""
    out: TensorMap = {}
    for name, place in text_map.items():
        if name.startswith("model."):
            rest = name.removeprefix("model.")
            out[f"language_model.model.{rest}"] = out[f"model.language_model.{rest}"] = place
        else:
            out[f"language_model.{name}"] = out[name] = place
    return out


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
    # the language model of a multimodal checkpoint: the config.json key its own keys are under,
    # e.g. "text_config" (None: a causal LM's own)
    hf_text_config: ClassVar[str | None] = None
    # a multimodal class that takes images: ``load_vision`` reads its vision tower beside the
    # language model, ``embed_multimodal`` makes an image's embeddings (False: served on text)
    takes_images: ClassVar[bool] = False
    # it takes videos too (``embed_multimodal("video", ...)``, config.json's video_token_id)
    takes_videos: ClassVar[bool] = False
    # a multimodal class that takes audio: ``load_audio`` reads its audio tower beside the language
    # model, ``embed_multimodal("audio", ...)`` makes a clip's embeddings (config.json's audio_token_index)
    takes_audio: ClassVar[bool] = False
    # tensor-name prefixes the language model's tensor map does not read (a vision tower, its
    # projector: ``load_vision`` reads those where the class takes images)
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = ()
    # its layers can attend both ways (config.json's use_bidirectional_attention, an encoder's:
    # ArchConfig.encoder_only), as LlamaBidirectionalModel's do
    bidirectional_layers: ClassVar[bool] = False
    # pipeline parallelism (models/pipeline_parallel.py): what a stage hands the next, each
    # (tokens, hidden); () when the forward takes no intermediate tensors (one stage only)
    intermediate_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """config.json under transformers' common key names (hidden_size, num_attention_heads, ...)
        for an architecture whose config names them otherwise; as it is here."""
        return raw

    def hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """A Hugging Face checkpoint's (name, tensor) pairs as the tensor map reads them (a fused
        tensor the model holds as two parts, split; rows in the model's order: ``hf_rows``)."""
        return ((name, self.hf_rows(name, tensor)) for name, tensor in weights)

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rows of checkpoint tensor ``name`` in the order this model holds them (a LoRA
        adapter's B rows for that module follow the same order); as they are here."""
        return tensor

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
