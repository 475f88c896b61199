"""Qwen2: Llama with biases on the q/k/v projections, always, and optional sliding-window layers
(``layer_types``); the tensor names are Llama's. llama.cpp runs it with NeoX rotary, so its
GGUF keeps q/k rows as they are. Qwen2-VL's and Qwen2.5-VL's checkpoints serve their language
model and their images, Qwen2-Audio's its language model and its audio."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from models.base import QWEN_VISION_PREFIXES, TensorMap, language_model_tensor_map
from models.config import FULL, SLIDING
from models.llama import LlamaForCausalLM
from models.vision import AudioTower, whisper_rows


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


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2-VL's checkpoints (a vision tower beside the language model): the language model
    with its images (``load_vision``: transformers' vision tower and patch merger, read from the
    checkpoint), or on text alone with --language-model-only (the vision tensors never read).
    An image's tokens take M-RoPE's positions (models/mrope.py: time, height and width rows,
    each turning its section of the rotary frequencies); a text token's rows agree, plain rope.
    The hub's tensors keep the language model at ``model.*`` (the vision tower at ``visual.*``),
    transformers 5's at ``model.language_model.*`` (``model.visual.*``). llama.cpp writes the
    language model of both as a "qwen2vl" GGUF (Qwen2's tensors, the M-RoPE sections in its
    header), served on text."""
    hf_text_config: ClassVar[str | None] = "text_config"
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = QWEN_VISION_PREFIXES
    takes_images: ClassVar[bool] = True
    takes_videos: ClassVar[bool] = True
    vision_family: ClassVar[str] = "qwen2_vl"
    gguf_architectures: ClassVar[tuple[str, ...]] = ("qwen2vl",)
    hf_tensor_map: ClassVar[TensorMap] = {**Qwen2ForCausalLM.hf_tensor_map,
                                          **language_model_tensor_map(Qwen2ForCausalLM.hf_tensor_map)}

    def load_vision(self, path: str, overrides: dict[str, Any] | None = None) -> None:
        """The vision tower with its patch merger (projecting to the language model's width),
        built by transformers from the checkpoint's vision_config and read from its tensors."""
        from models.vision import load_vision_parts
        self.visual, = load_vision_parts(path, overrides, self.vision_family, self.embed_tokens.weight.dtype)

    def embed_multimodal(self, modality: str, data: dict[str, Any]) -> torch.Tensor:
        """One image's embeddings (its merged patches, hidden) from its flattened patches and
        their grid (``pixel_values``, ``image_grid_thw``), or its embeddings as given; a video's
        from its patches of frames (``pixel_values_videos``, ``video_grid_thw``) by the same tower."""
        from models.vision import grid_of, image_embeddings
        return image_embeddings(self, modality, data, lambda pixels: self.visual(
            pixels, grid_thw=grid_of(data, modality, pixels.device)).pooler_output)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL's checkpoints: as Qwen2-VL's, with its vision tower (windowed attention, a
    gated MLP); its GGUF is Qwen2-VL's class's."""
    vision_family: ClassVar[str] = "qwen2_5_vl"
    gguf_architectures: ClassVar[tuple[str, ...]] = ()


# transformers' Qwen2Config defaults: the hub's audio checkpoints state few text keys
QWEN2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22_016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32_768,
    "rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False}


class Qwen2AudioForConditionalGeneration(AudioTower, Qwen2ForCausalLM):
    """Qwen2-Audio's checkpoints: a Whisper-style audio tower (two convolutions over the log-mel
    frames, an encoder, a pooling by two) and a linear projector beside a Qwen2. The language
    model is Troupe's Qwen2; ``load_audio`` builds transformers' audio tower and projector from the
    checkpoint's audio_config and reads them. A clip's embeddings are the projector's of the tower's
    outputs over its own frames, as transformers' Qwen2-Audio makes them (which runs the tower over
    the whole 30-second window with the padding masked out of the attention, then cuts it off):
    the encoder's layers run over the clip's own positions alone (``whisper_rows``), so a 10-second
    clip costs a third of the window. With --language-model-only the audio tensors are never read."""
    audio_family: ClassVar[str] = "qwen2_audio"
    audio_mask: ClassVar[str] = "feature_attention_mask"     # the processor's mask of each window's own frames
    hf_defaults: ClassVar[dict[str, Any]] = QWEN2_DEFAULTS
    hf_tensor_map: ClassVar[TensorMap] = language_model_tensor_map(Qwen2ForCausalLM.hf_tensor_map)

    def encode_audio(self, data: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """From its windows' log-mel features padded to the window (``input_features``, (windows,
        mel bins, frames); Qwen2-Audio's processor makes one) and the masks of their own frames
        (``audio_mask``): the windows' rows one after another."""
        import numpy as np
        features = torch.as_tensor(np.asarray(data["input_features"]), device=device).to(dtype)
        frames = np.asarray(data[self.audio_mask]).reshape(len(features), -1).sum(-1).tolist()
        rows = torch.cat([whisper_rows(self.audio_tower, features[i:i + 1], int(n)) for i, n in enumerate(frames)])
        return self.multi_modal_projector(rows)


class AudioFlamingo3ForConditionalGeneration(Qwen2AudioForConditionalGeneration):
    """Audio Flamingo 3: Qwen2-Audio's shape (a Whisper encoder with its masked window and pooling
    by two, here a two-layer projector, a Qwen2), its processor cutting a clip into windows of its
    feature extractor's 30 s (up to its ``max_audio_len``, 600 s), each padded to the window; a
    clip's embeddings are, window by window, the projector's of the encoder's rows over the
    window's own frames (``whisper_rows``), as transformers' get_audio_features makes them over the
    masked windows."""
    audio_family: ClassVar[str] = "audioflamingo3"
    audio_mask: ClassVar[str] = "input_features_mask"
