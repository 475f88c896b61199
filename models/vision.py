"""The vision side of a multimodal checkpoint served by Troupe's own language model classes:
transformers builds the vision tower and the projector from the checkpoint's config.json, and
their tensors are read from its safetensors files (the hub's names or transformers 5's,
``model.``-prefixed). The language model stays Troupe's own; an image's embeddings take its
placeholder positions (``embed_multimodal``)."""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from models.safetensors_loader import iter_safetensors_weights

# each family's projector class in transformers, and its two parts' tensor-name prefixes
_PROJECTORS = {"gemma3": "transformers.models.gemma3.modeling_gemma3:Gemma3MultiModalProjector"}
_PARTS = ("vision_tower.", "multi_modal_projector.")


def load_vision_parts(path: str, overrides: dict[str, Any] | None, family: str,
                      dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """(vision tower, projector) of the checkpoint directory ``path``, in ``dtype``, their
    tensors all read (ValueError naming what is missing or left over)."""
    import importlib

    from transformers import AutoModel

    from models.hf_config import with_overrides
    from models.transformers_backend import transformers_config
    with open(os.path.join(path, "config.json")) as f:
        config = transformers_config(with_overrides(json.load(f), overrides or {}))
    tower = AutoModel.from_config(config.vision_config, attn_implementation="sdpa")
    module, _, name = _PROJECTORS[family].partition(":")
    projector = getattr(importlib.import_module(module), name)(config)
    states: dict[str, dict[str, torch.Tensor]] = {part: {} for part in _PARTS}
    for name, tensor in iter_safetensors_weights(path, only_prefixes=_PARTS + tuple(f"model.{p}" for p in _PARTS)):
        bare = name.removeprefix("model.")
        for part in _PARTS:
            if bare.startswith(part):
                states[part][bare.removeprefix(part)] = tensor
    for part, module_ in zip(_PARTS, (tower, projector)):
        missing, unexpected = module_.load_state_dict(states[part], strict=False)
        missing = [m for m in missing if not m.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(f"{path}: the checkpoint's {part.rstrip('.')} does not fit {type(module_).__name__}: "
                             f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    return tower.to(dtype).eval(), projector.to(dtype).eval()


def image_embeddings(model: nn.Module, modality: str, data: dict[str, Any],
                     encode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One image's embeddings (positions, hidden) in the model's dtype and device: ``encode``
    of its pixel values, or its embeddings as given (``image_embeds``)."""
    if modality != "image":
        raise ValueError(f"{type(model).__name__} takes no {modality} input")
    weight = model.embed_tokens.weight
    if "image_embeds" in data:
        return torch.as_tensor(np.asarray(data["image_embeds"]), device=weight.device).to(weight.dtype)
    pixels = torch.as_tensor(np.asarray(data["pixel_values"]), device=weight.device).to(weight.dtype)
    out = encode(pixels)
    return out.reshape(-1, out.shape[-1])
