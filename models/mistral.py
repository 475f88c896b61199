"""Mistral: Llama whose layers may all use one sliding window (``config.sliding_window``);
the tensor names are Llama's, and llama.cpp converts it as a "llama" GGUF. Mistral 3's
multimodal checkpoints serve their language model and their images."""
from __future__ import annotations

import json
import os
from typing import Any, ClassVar

import numpy as np
import torch

from models.base import VISION_PREFIXES, TensorMap, language_model_tensor_map
from models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {"sliding_window": 4096}
    gguf_architectures: ClassVar[tuple[str, ...]] = ()   # its GGUF says "llama": read as Llama

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """One window for every layer (null: none); transformers ignores layer_types."""
        return {"sliding_window": raw["sliding_window"]}


class Mistral3ForConditionalGeneration(MistralForCausalLM):
    """Mistral Small 3.1 and 3.2 as published (a Pixtral vision tower beside the language model):
    the language model with its images (``load_vision``: transformers' Pixtral tower and Mistral
    3's projector with its patch merger, read from the checkpoint), or on text alone with
    --language-model-only (the vision tensors never read)."""
    hf_text_config: ClassVar[str | None] = "text_config"
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = VISION_PREFIXES
    takes_images: ClassVar[bool] = True
    hf_tensor_map: ClassVar[TensorMap] = language_model_tensor_map(LlamaForCausalLM.hf_tensor_map)

    def load_vision(self, path: str, overrides: dict[str, Any] | None = None) -> None:
        """The Pixtral vision tower and the projector, built by transformers from the
        checkpoint's config and read from its tensors (either layout); the tower's layer whose
        outputs the projector takes (``vision_feature_layer``, the last by default)."""
        from models.hf_config import with_overrides
        from models.vision import load_vision_parts
        self.vision_tower, self.multi_modal_projector = load_vision_parts(path, overrides, "mistral3",
                                                                          self.embed_tokens.weight.dtype)
        with open(os.path.join(path, "config.json")) as f:
            self.vision_feature_layer = with_overrides(json.load(f), overrides or {}).get("vision_feature_layer", -1)

    def embed_multimodal(self, modality: str, data: dict[str, Any]) -> torch.Tensor:
        """One image's embeddings (its merged patches, hidden) from its pixel values (padded, a
        batch of one) and its size after resizing (``image_sizes``), as transformers'
        get_image_features makes them."""
        from models.vision import image_embeddings

        def encode(pixels: torch.Tensor) -> torch.Tensor:
            sizes = torch.as_tensor(np.asarray(data["image_sizes"]), device=pixels.device)
            states = self.vision_tower(pixels, image_sizes=sizes, output_hidden_states=True, return_dict=True).hidden_states
            layer = self.vision_feature_layer
            feature = states[layer] if isinstance(layer, int) else torch.cat([states[i] for i in layer], dim=-1)
            return self.multi_modal_projector(feature.squeeze(0), sizes)
        return image_embeddings(self, modality, data, encode)
