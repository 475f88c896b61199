"""Qwen3: Llama with a per-head RMSNorm of q and k before rotary, no q/k/v bias by default, and
Qwen2's sliding-window rule; its GGUF, like Qwen2's, keeps q/k rows as they are. Qwen3-VL's
checkpoints serve their language model, their images and their videos."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from models.base import QWEN_VISION_PREFIXES, TensorMap, language_model_tensor_map
from models.llama import LlamaForCausalLM
from models.qwen2 import qwen_sliding_fields


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm: ClassVar[bool] = True
    hf_defaults: ClassVar[dict[str, Any]] = {"head_dim": 128}
    gguf_architectures: ClassVar[tuple[str, ...]] = ("qwen3",)
    gguf_permuted_qk: ClassVar[bool] = False

    gguf_tensor_map: ClassVar[TensorMap] = {
        **LlamaForCausalLM.gguf_tensor_map,
        "blk.{i}.attn_q_norm.weight": ("layers.{i}.self_attn.q_norm.weight", None),
        "blk.{i}.attn_k_norm.weight": ("layers.{i}.self_attn.k_norm.weight", None),
    }
    hf_tensor_map: ClassVar[TensorMap] = {
        **LlamaForCausalLM.hf_tensor_map,
        "model.layers.{i}.self_attn.q_norm.weight": ("layers.{i}.self_attn.q_norm.weight", None),
        "model.layers.{i}.self_attn.k_norm.weight": ("layers.{i}.self_attn.k_norm.weight", None),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return qwen_sliding_fields(raw, fields["num_layers"])


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    """Qwen3-VL's checkpoints: the language model with its images and videos (``load_vision``:
    transformers' vision tower, read from the checkpoint), or on text alone with
    --language-model-only (the vision tensors never read). An image's tokens take interleaved
    M-RoPE positions (models/mrope.py), and its DeepStack features, made by the tower's
    intermediate blocks, are added to the outputs of the first decoder layers at its positions
    (``embed_multimodal`` returns them beside its embeddings, one hidden-wide slice per layer). A
    video's temporal patches each follow their timestamp as text and take positions as images do."""
    hf_text_config: ClassVar[str | None] = "text_config"
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = QWEN_VISION_PREFIXES
    takes_images: ClassVar[bool] = True
    takes_videos: ClassVar[bool] = True
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_tensor_map: ClassVar[TensorMap] = {**Qwen3ForCausalLM.hf_tensor_map,
                                          **language_model_tensor_map(Qwen3ForCausalLM.hf_tensor_map)}

    def load_vision(self, path: str, overrides: dict[str, Any] | None = None) -> None:
        """The vision tower (its patch merger and DeepStack mergers inside), built by
        transformers from the checkpoint's vision_config and read from its tensors."""
        from models.vision import load_vision_parts
        self.visual, = load_vision_parts(path, overrides, "qwen3_vl", self.embed_tokens.weight.dtype)

    def check_pipeline_stage(self, start: int, end: int) -> None:
        """ValueError where the first pipeline stage holds fewer layers than DeepStack feeds
        (the features reach the first stage alone)."""
        fed = len(self.visual.deepstack_visual_indexes) if hasattr(self, "visual") else 0
        if start == 0 and end < fed:
            raise ValueError(f"Qwen3-VL adds an image's DeepStack features to its first {fed} layers, and the first "
                             f"pipeline stage holds {end}: use fewer pipeline stages")

    def embed_multimodal(self, modality: str, data: dict[str, Any]) -> torch.Tensor:
        """One image's or video's embeddings with its DeepStack features beside them, (merged
        patches, hidden * (1 + DeepStack layers)), from its flattened patches and their grid."""
        from models.vision import grid_of, image_embeddings

        def encode(pixels: torch.Tensor) -> torch.Tensor:
            out = self.visual(pixels, grid_thw=grid_of(data, modality, pixels.device), return_dict=True)
            return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
        return image_embeddings(self, modality, data, encode)

