"""The Llama architecture (SmolLM2, Llama 2/3 without rope scaling beyond linear) over a paged
KV cache. Qwen2, Qwen3, Mistral and Phi-3 are this model with their differences declared (a
tensor map, a flag, a config hook)."""
from __future__ import annotations

import json
import os
from typing import Any, ClassVar

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import VISION_PREFIXES, CausalLM, TensorMap, language_model_tensor_map
from models.config import ArchConfig
from models.layers import (Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding, SelfAttention,
                           kv_layer_hooks_active)
from models.pipeline_parallel import IntermediateTensors, is_last_stage, stage_layers
from models.vision import AudioTower


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 qk_norm: bool = False, qk_norm_whole: bool = False) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, backend, dtype, scale=c.attn_scale,
            sliding_window=c.layer_sliding_window(layer), qkv_bias=c.qkv_bias, o_bias=c.o_bias,
            qk_norm=(lambda: RMSNorm(c.head_size, c.rms_norm_eps, dtype)) if qk_norm else None,
            rotary_dim=c.rotary_dim, use_rope=c.layer_uses_rope(layer), bidirectional=c.encoder_only,
            qk_norm_whole=(lambda size: RMSNorm(size, c.rms_norm_eps, dtype)) if qk_norm_whole else None,
            sinks=c.attention_sinks, output_gate=c.attn_output_gate)
        self.residual_multiplier = c.residual_multiplier
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried apart from the sublayer outputs, so each add folds into
        the next norm: with r the stream entering the layer (r = hidden + residual, or hidden in
        the first layer), r' = r + attn(norm(r)) and the layer returns (mlp(norm(r')), r'); the
        next norm (or the final one) adds the two."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.mix(hidden, cos, sin, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


    def mix(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The layer's token mixer: attention here (a hybrid model's state-space layers mix with
        their recurrent state instead: models/mamba.py)."""
        return self.self_attn(hidden, cos, sin, kv_cache, meta)


class LlamaForCausalLM(CausalLM):
    qk_norm: ClassVar[bool] = False   # per-head RMSNorm of q and k before rotary (Qwen3)
    qk_norm_whole: ClassVar[bool] = False   # RMSNorm of all of q's and of k's features at once (OLMoE)
    bidirectional_layers: ClassVar[bool] = True     # LlamaBidirectionalModel: its layers attend both ways
    gguf_architectures: ClassVar[tuple[str, ...]] = ("llama",)
    gguf_permuted_qk: ClassVar[bool] = True
    intermediate_keys: ClassVar[tuple[str, ...]] = ("hidden_states", "residual")
    decoder_layer: ClassVar[type[nn.Module]] = LlamaDecoderLayer     # (config, layer, backend, dtype, qk norms)
    # models/native_decode.py: all layers of a pure-decode step in one native call (CPU), set
    # once the weights are packed when the layers qualify; the per-layer path otherwise.
    native_decode = None

    gguf_tensor_map: ClassVar[TensorMap] = {
        "token_embd.weight": ("embed_tokens.weight", None),
        "blk.{i}.attn_norm.weight": ("layers.{i}.input_layernorm.weight", None),
        **{f"blk.{{i}}.attn_{s}.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", s)
           for s in "qkv" for p in ("weight", "bias")},
        "blk.{i}.attn_output.weight": ("layers.{i}.self_attn.o_proj.weight", None),
        "blk.{i}.attn_output.bias": ("layers.{i}.self_attn.o_proj.bias", None),
        "blk.{i}.ffn_norm.weight": ("layers.{i}.post_attention_layernorm.weight", None),
        "blk.{i}.ffn_gate.weight": ("layers.{i}.mlp.gate_up_proj.weight", "gate"),
        "blk.{i}.ffn_up.weight": ("layers.{i}.mlp.gate_up_proj.weight", "up"),
        "blk.{i}.ffn_down.weight": ("layers.{i}.mlp.down_proj.weight", None),
        "output_norm.weight": ("norm.weight", None),
        "output.weight": ("lm_head.weight", None),
    }
    hf_tensor_map: ClassVar[TensorMap] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        "model.layers.{i}.input_layernorm.weight": ("layers.{i}.input_layernorm.weight", None),
        **{f"model.layers.{{i}}.self_attn.{s}_proj.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", s)
           for s in "qkv" for p in ("weight", "bias")},
        "model.layers.{i}.self_attn.o_proj.weight": ("layers.{i}.self_attn.o_proj.weight", None),
        "model.layers.{i}.self_attn.o_proj.bias": ("layers.{i}.self_attn.o_proj.bias", None),
        "model.layers.{i}.post_attention_layernorm.weight": ("layers.{i}.post_attention_layernorm.weight", None),
        "model.layers.{i}.mlp.gate_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", "gate"),
        "model.layers.{i}.mlp.up_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", "up"),
        "model.layers.{i}.mlp.down_proj.weight": ("layers.{i}.mlp.down_proj.weight", None),
        "model.norm.weight": ("norm.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
    }

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.attn_logit_softcapping is not None:
            raise ValueError(f"{type(self).__name__}: attention logit softcapping is not supported")
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim or config.head_size, config.rope_positions, config.rope_theta,
                                          config.rope_scaling, config.serving_len, config.mrope_section,
                                          config.mrope_interleaved)
        qk_norm = self.qk_norm or config.qk_norm
        self.layers = nn.ModuleList(self.decoder_layer(config, i, attn_backend, dtype, qk_norm, self.qk_norm_whole)
                                    for i in range(config.num_layers))
        self.start_layer, self.end_layer = 0, config.num_layers     # a pipeline stage's (pipeline_parallel.py)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        tied = self.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype, weight=tied)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' input embeddings (T,) -> (T, hidden): what vLLM's prompt embeds stand for."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | IntermediateTensors:
        # input_ids, positions (T,) int64 (M-RoPE's (3, T)); kv_caches[l] (2, num_blocks,
        # block_size, KVH, D), one per layer this stage runs; ``intermediate``: the previous
        # pipeline stage's tensors; ``inputs_embeds`` (T, hidden): the first stage's inputs instead
        # of the tokens' embeddings; ``deepstack``: (image positions (k,), features (n, k, hidden)),
        # Qwen3-VL's, added to the outputs of the first n layers at those positions
        layers = stage_layers(self, kv_caches)
        if intermediate is None:
            hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            if self.config.embedding_multiplier != 1.0:                     # Granite's, on prompt embeds too
                hidden = hidden * self.config.embedding_multiplier
            residual = None                                                 # (T, hidden)
        else:
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        cos, sin = self.rotary_emb(positions, hidden.dtype)    # (T, 1, D) each
        if self.native_decode is not None and intermediate is None and deepstack is None \
                and not kv_layer_hooks_active():
            out = self.native_decode.run(hidden, cos, sin, kv_caches, meta)
            if out is not None:
                return self.norm(*out)[0]
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
            if deepstack is not None and self.start_layer + i < len(deepstack[1]):
                hidden = hidden.index_add(0, deepstack[0], deepstack[1][self.start_layer + i].to(hidden.dtype))
        if not is_last_stage(self):
            return {"hidden_states": hidden, "residual": residual}
        return self.norm(hidden, residual)[0] if residual is not None else self.norm(hidden)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()                  # (N, hidden) -> (N, vocab) float32
        scaling = self.config.logits_scaling
        return logits if scaling == 1.0 else logits / scaling


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """LLaVA (1.5 and its kind) as published: a CLIP vision tower and a projector beside a Llama.
    The language model is Troupe's Llama; ``load_vision`` builds transformers' vision tower and
    LLaVA's projector from the checkpoint's config and reads them (either layout). An image's
    embeddings are the projector's of the tower layer ``vision_feature_layer`` (the second to last
    by default; a list: those layers side by side), its CLS position dropped ("default" strategy)
    or kept ("full"), as transformers' get_image_features makes them. Its language model of another
    kind than Llama is served whole by the transformers backend (``auto``); with
    --language-model-only the vision tensors are never read."""
    hf_text_config: ClassVar[str | None] = "text_config"
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = VISION_PREFIXES
    takes_images: ClassVar[bool] = True
    hf_tensor_map: ClassVar[TensorMap] = language_model_tensor_map(LlamaForCausalLM.hf_tensor_map)
    gguf_architectures: ClassVar[tuple[str, ...]] = ()

    def load_vision(self, path: str, overrides: dict[str, Any] | None = None) -> None:
        from models.hf_config import with_overrides
        from models.vision import load_vision_parts
        self.vision_tower, self.multi_modal_projector = load_vision_parts(path, overrides, "llava",
                                                                          self.embed_tokens.weight.dtype)
        with open(os.path.join(path, "config.json")) as f:
            raw = with_overrides(json.load(f), overrides or {})
        self.vision_feature_layer = raw.get("vision_feature_layer", -2)
        self.vision_feature_select_strategy = raw.get("vision_feature_select_strategy", "default")

    def embed_multimodal(self, modality: str, data: dict[str, Any]) -> torch.Tensor:
        """One image's embeddings (its patches, hidden) from its pixel values (a batch of one), or
        its embeddings as given (--enable-mm-embeds)."""
        from models.vision import image_embeddings

        def encode(pixels: torch.Tensor) -> torch.Tensor:
            states = self.vision_tower(pixels, output_hidden_states=True, return_dict=True).hidden_states
            layers = self.vision_feature_layer
            chosen = [states[i] for i in ([layers] if isinstance(layers, int) else layers)]
            if self.vision_feature_select_strategy == "default":      # the CLS position dropped
                chosen = [s[:, 1:] for s in chosen]
            return self.multi_modal_projector(torch.cat(chosen, dim=-1))
        return image_embeddings(self, modality, data, encode)


class GlmAsrForConditionalGeneration(AudioTower, LlamaForCausalLM):
    """GLM-ASR (GLM-ASR-Nano): a Whisper-style audio encoder with rotary positions, a projector
    of four frames into one position, and a Llama. The language model is Troupe's Llama;
    ``load_audio`` builds transformers' encoder and projector from the checkpoint's audio_config
    and reads them. The processor cuts a clip into windows of its feature extractor's length
    (each padded to it); a clip's embeddings are, window by window, the projector's of the
    encoder's outputs over the whole window (it attends without a mask, as transformers' does), cut
    to the window's own frames, as transformers' get_audio_features makes them."""
    audio_family: ClassVar[str] = "glmasr"
    hf_defaults: ClassVar[dict[str, Any]] = {
        # transformers' GlmAsrConfig text defaults (GLM-ASR-Nano-2512's language model)
        "vocab_size": 59_264, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "eos_token_id": [59_246, 59_253, 59_255], "rope_theta": 10_000.0, "tie_word_embeddings": True}
    hf_tensor_map: ClassVar[TensorMap] = language_model_tensor_map(LlamaForCausalLM.hf_tensor_map)

    def encode_audio(self, data: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """From its windows' log-mel features (``input_features``, (windows, mel bins, frames)) and
        the masks of their own frames (``input_features_mask``)."""
        import numpy as np
        features = torch.as_tensor(np.asarray(data["input_features"]), device=device).to(dtype)
        frames = torch.as_tensor(np.asarray(data["input_features_mask"]), device=device).sum(-1)
        states = self.audio_tower(features).last_hidden_state
        merged = self.multi_modal_projector(states.reshape(features.shape[0], -1, 4 * states.shape[-1]))
        convolved = (frames - 1) // 2 + 1                  # after the stride-2 convolution
        own = (convolved - 4) // 4 + 1                     # merged positions of the window's own frames
        return torch.cat([merged[i, :int(n)] for i, n in enumerate(own.tolist())])
