"""The vision (or audio) side of a multimodal checkpoint served by Troupe's own language model
classes: transformers builds the vision tower (audio tower) and the projector from the
checkpoint's config.json, and their tensors are read from its safetensors files (the hub's names
or transformers 5's, ``model.``-prefixed). The language model stays Troupe's own; an image's (a
clip's) embeddings take its placeholder positions (``embed_multimodal``)."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, ClassVar

import numpy as np
import torch
from torch import nn

from models.base import AUDIO_PREFIXES
from models.safetensors_loader import iter_safetensors_weights

# each family's parts: their tensor-name prefix, and transformers' class that builds them from the
# checkpoint's config ("vision:" a class of its vision_config, "audio:" of its audio_config; None:
# AutoModel's of its vision_config)
_FAMILIES: dict[str, tuple[tuple[str, str | None], ...]] = {
    "gemma3": (("vision_tower.", None),
               ("multi_modal_projector.", "transformers.models.gemma3.modeling_gemma3:Gemma3MultiModalProjector")),
    # the vision tower and its patch merger, one module (the merger projects to the language model)
    "qwen2_vl": (("visual.", "vision:transformers.models.qwen2_vl.modeling_qwen2_vl:"
                             "Qwen2VisionTransformerPretrainedModel"),),
    "qwen2_5_vl": (("visual.", "vision:transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:"
                               "Qwen2_5_VisionTransformerPretrainedModel"),),
    "qwen3_vl": (("visual.", None),),       # with its DeepStack mergers
    "llava": (("vision_tower.", None),       # CLIP's (or SigLIP's)
              ("multi_modal_projector.", "transformers.models.llava.modeling_llava:LlavaMultiModalProjector")),
    "mistral3": (("vision_tower.", None),    # Pixtral's
                 ("multi_modal_projector.", "transformers.models.mistral3.modeling_mistral3:Mistral3MultiModalProjector")),
    "audioflamingo3": (("audio_tower.", "audio:transformers.models.audioflamingo3.modeling_audioflamingo3:"
                                        "AudioFlamingo3Encoder"),
                       ("multi_modal_projector.", "transformers.models.audioflamingo3.modeling_audioflamingo3:"
                                                  "AudioFlamingo3MultiModalProjector")),
    "glmasr": (("audio_tower.", "audio:transformers.models.glmasr.modeling_glmasr:GlmAsrEncoder"),
               ("multi_modal_projector.", "transformers.models.glmasr.modeling_glmasr:GlmAsrMultiModalProjector")),
    "qwen2_audio": (("audio_tower.", "audio:transformers.models.qwen2_audio.modeling_qwen2_audio:Qwen2AudioEncoder"),
                    ("multi_modal_projector.", "transformers.models.qwen2_audio.modeling_qwen2_audio:"
                                               "Qwen2AudioMultiModalProjector")),
}


# tensors a family's checkpoints hold that its modules do not read (GLM-ASR's unused position table)
_UNREAD: dict[str, tuple[str, ...]] = {"glmasr": ("audio_tower.embed_positions.",)}


def load_vision_parts(path: str, overrides: dict[str, Any] | None, family: str,
                      dtype: torch.dtype) -> tuple[nn.Module, ...]:
    """The vision parts of ``family`` (``_FAMILIES``: LLaVA's, Gemma 3's and Mistral 3's vision tower and
    projector, Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's towers; Qwen2-Audio's audio tower and
    projector) of the checkpoint directory ``path``, in
    ``dtype``, their tensors all read (ValueError naming what is missing or left over)."""
    import importlib

    from transformers import AutoModel

    from models.hf_config import with_overrides
    from models.transformers_backend import transformers_config
    with open(os.path.join(path, "config.json")) as f:
        config = transformers_config(with_overrides(json.load(f), overrides or {}))
    parts = _FAMILIES[family]
    modules = []
    for _, where in parts:
        if where is None:
            modules.append(AutoModel.from_config(config.vision_config, attn_implementation="sdpa"))
            continue
        side, _, where = where.partition(":") if where.startswith(("vision:", "audio:")) else ("", "", where)
        module, _, name = where.partition(":")
        cls = getattr(importlib.import_module(module), name)
        modules.append(cls._from_config(getattr(config, f"{side}_config"), attn_implementation="sdpa") if side
                       else cls(config))
    prefixes = tuple(prefix for prefix, _ in parts)
    states: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in prefixes}
    for name, tensor in iter_safetensors_weights(path, only_prefixes=prefixes + tuple(f"model.{p}" for p in prefixes)):
        bare = name.removeprefix("model.")
        if bare.startswith(_UNREAD.get(family, ())):
            continue
        for prefix in prefixes:
            if bare.startswith(prefix):
                states[prefix][bare.removeprefix(prefix)] = tensor
    for prefix, module_ in zip(prefixes, modules):
        missing, unexpected = module_.load_state_dict(states[prefix], strict=False)
        missing = [m for m in missing if not m.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(f"{path}: the checkpoint's {prefix.rstrip('.')} does not fit {type(module_).__name__}: "
                             f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    return tuple(m.to(dtype).eval() for m in modules)


def image_embeddings(model: nn.Module, modality: str, data: dict[str, Any],
                     encode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One image's embeddings (positions, hidden) in the model's dtype and device: ``encode``
    of its pixel values, or its embeddings as given (``image_embeds``); a video's, for a model
    that takes videos, ``encode`` of its patches of frames (``pixel_values_videos``) or its
    embeddings as given (``video_embeds``)."""
    video = modality == "video" and getattr(model, "takes_videos", False)
    if modality != "image" and not video:
        raise ValueError(f"{type(model).__name__} takes no {modality} input")
    weight = model.embed_tokens.weight
    given = data.get("video_embeds" if video else "image_embeds")
    if given is not None:
        return torch.as_tensor(np.asarray(given), device=weight.device).to(weight.dtype)
    pixels = np.asarray(data["pixel_values_videos" if video else "pixel_values"])
    out = encode(torch.as_tensor(pixels, device=weight.device).to(weight.dtype))
    return out.reshape(-1, out.shape[-1])


def grid_of(data: dict[str, Any], modality: str, device: torch.device) -> torch.Tensor:
    """An image's or video's grid of patches (``image_grid_thw``, ``video_grid_thw``) on ``device``."""
    return torch.as_tensor(np.asarray(data["video_grid_thw" if modality == "video" else "image_grid_thw"]),
                           device=device)


class AudioTower:
    """What a language model class that takes audio adds (put first among its bases): its audio
    tower and projector (``audio_family``'s in ``_FAMILIES``) read beside the language model, their
    tensors skipped by its loader, and a clip's embeddings: ``encode_audio`` of its features, or its
    rows as given (``audio_embeds``, with --enable-mm-embeds)."""
    audio_family: ClassVar[str]
    takes_audio: ClassVar[bool] = True
    hf_text_config: ClassVar[str | None] = "text_config"
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = AUDIO_PREFIXES
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    embed_tokens: nn.Module

    def load_audio(self, path: str, overrides: dict[str, Any] | None = None) -> None:
        self.audio_tower, self.multi_modal_projector = load_vision_parts(path, overrides, self.audio_family,
                                                                         self.embed_tokens.weight.dtype)

    def embed_multimodal(self, modality: str, data: dict[str, Any]) -> torch.Tensor:
        if modality != "audio":
            raise ValueError(f"{type(self).__name__} takes no {modality} input")
        weight = self.embed_tokens.weight
        given = data.get("audio_embeds")
        if given is not None:
            return torch.as_tensor(np.asarray(given), device=weight.device).to(weight.dtype)
        return self.encode_audio(data, weight.device, weight.dtype)

    def encode_audio(self, data: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """One clip's embeddings (its audio positions, hidden) from its processor's inputs."""
        raise NotImplementedError


def whisper_rows(tower: nn.Module, features: torch.Tensor, frames: int) -> torch.Tensor:
    """A Whisper-style encoder's outputs (two convolutions, a position table, the layers, a pooling
    by two, a LayerNorm: Qwen2-Audio's, AudioFlamingo 3's) for one window of log-mel features
    ``features`` (1, mel bins, window frames) whose first ``frames`` are the clip's own, the rest
    padding: (own positions after the pooling, width). The layers run over the clip's own positions
    alone: the padding never reaches them (masked keys, the convolutions' reach one frame past the
    clip, the pooling within it), so the rows are those of the whole window with the padding
    masked out of the attention, as transformers runs it, at a fraction of the cost."""
    from torch.nn import functional as F
    window = tower.max_source_positions * tower.conv1.stride[0] * tower.conv2.stride[0]
    if features.shape[-1] != window:
        raise ValueError(f"the audio tower takes log-mel features of {window} frames, got {features.shape[-1]}")
    own = (frames - 1) // 2 + 1                # positions after the stride-2 convolution
    # the convolutions' reach past the last of them: frames up to 2 * own (one of padding)
    states = F.gelu(tower.conv2(F.gelu(tower.conv1(features[..., :min(window, 2 * own + 2)]))))
    states = states[..., :own].permute(0, 2, 1) + tower.embed_positions.weight[:own]
    for layer in tower.layers:
        states = layer(states, None)
        states = states[0] if isinstance(states, tuple) else states
    states = tower.layer_norm(tower.avg_pooler(states.permute(0, 2, 1)).permute(0, 2, 1))
    return states[0, :(own - 2) // 2 + 1]
