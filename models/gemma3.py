"""Gemma 3 (text): sliding-window layers interleaved with global ones, each kind with its own
rotary base; (1 + weight) RMSNorms before and after attention and the MLP; per-head q/k norm;
embeddings scaled by sqrt(hidden); gelu-tanh MLP; tied LM head, optional final softcap.
Its GGUF stores the norms as 1 + weight and leaves out what llama.cpp hard-codes. The 4B-27B
checkpoints (Gemma3ForConditionalGeneration) serve their language model."""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import VISION_PREFIXES, CausalLM, Fixups, TensorMap, language_model_tensor_map
from models.config import FULL, SLIDING, ArchConfig
from models.gguf_loader import GGUFArchKeys
from models.hf_config import rope_parameters
from models.layers import Embedding, GatedMLP, GemmaRMSNorm, Linear, RotaryEmbedding, SelfAttention
from models.pipeline_parallel import IntermediateTensors, is_last_stage, stage_layers

SLIDING_PATTERN = 6           # transformers' and llama.cpp's default: every 6th layer is global
LOCAL_ROPE_THETA = 10_000.0   # the sliding layers' rotary base, when a config does not say


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 qk_norm: bool = True) -> None:
        super().__init__()
        c = config
        # a sliding layer by its type (its rotary base is the local one even with the window off)
        self.is_sliding = (c.layer_types[layer] == SLIDING if c.layer_types is not None
                           else c.layer_sliding_window(layer) is not None)
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, backend, dtype, scale=c.attn_scale,
            sliding_window=c.layer_sliding_window(layer), qkv_bias=c.qkv_bias, o_bias=c.o_bias,
            qk_norm=(lambda: GemmaRMSNorm(c.head_size, c.rms_norm_eps, dtype)) if qk_norm else None,
            logits_soft_cap=c.attn_logit_softcapping, bidirectional=c.encoder_only)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


_LAYER = {  # Hugging Face name under model.layers.{i}. -> GGUF name under blk.{i}.
    "input_layernorm": "attn_norm",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.down_proj": "ffn_down",
}
_FUSED = {  # Hugging Face name -> (GGUF name, our fused parameter, shard)
    "self_attn.q_proj": ("attn_q", "self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("attn_k", "self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("attn_v", "self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("ffn_gate", "mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("ffn_up", "mlp.gate_up_proj", "up"),
}


def _layer_types(pattern: int, num_layers: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


class LocalGlobalLM(CausalLM):
    """A decoder whose layers carry one stream (the hidden states) and each turn q and k by the
    global rotary (``rotary_global``) or, a sliding layer (``is_sliding``), by the local one
    (``rotary_local``, None where no layer slides): Gemma 3's and OLMo's forward, a pipeline
    stage's layers only."""
    intermediate_keys: ClassVar[tuple[str, ...]] = ("hidden_states",)
    rotary_local: RotaryEmbedding | None

    def build(self, config: ArchConfig, dtype: torch.dtype, layer: Callable[[int], nn.Module], norm: nn.Module,
              local: bool, lm_head_bias: bool = False) -> None:
        """The parts such a model has: the embedding, the global rotary (over ``rotary_dim`` where
        partial) and, with ``local``, the sliding layers' (their own base), ``layer(i)`` for every
        layer, the final ``norm``, and the LM head (tied where the config says)."""
        c = self.config = config
        turned = c.rotary_dim or c.head_size
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.rotary_global = RotaryEmbedding(turned, c.rope_positions, c.rope_theta, c.rope_scaling, c.serving_len)
        self.rotary_local = RotaryEmbedding(turned, c.rope_positions, c.rope_local_theta or c.rope_theta) if local else None
        self.layers = nn.ModuleList(layer(i) for i in range(c.num_layers))
        self.start_layer, self.end_layer = 0, c.num_layers     # a pipeline stage's (pipeline_parallel.py)
        self.norm = norm
        tied = self.embed_tokens.weight if c.tie_word_embeddings else None
        self.lm_head = Linear(c.hidden_size, c.vocab_size, dtype, weight=tied, bias=lm_head_bias)

    def input_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input: the tokens' embeddings, or ``inputs_embeds`` (GPT-2 adds its
        learned positions')."""
        return self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        # input_ids, positions (T,) int64; kv_caches[l] (2, num_blocks, block_size, KVH, D), one
        # per layer this stage runs; ``intermediate``: the previous pipeline stage's tensors;
        # ``inputs_embeds`` (T, hidden): the first stage's inputs instead of the tokens' embeddings
        layers = stage_layers(self, kv_caches)
        if intermediate is None:
            hidden = self.input_hidden(input_ids, positions, inputs_embeds)
        else:
            hidden = intermediate["hidden_states"]
        rope_global = self.rotary_global(positions, hidden.dtype)                 # cos, sin (T, 1, D)
        rope_local = self.rotary_local(positions, hidden.dtype) if self.rotary_local is not None else None
        for layer, kv_cache in zip(layers, kv_caches):
            cos, sin = rope_local if layer.is_sliding else rope_global
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        if not is_last_stage(self):
            return {"hidden_states": hidden}
        return self.norm(hidden)                                                  # (T, hidden)


class Gemma3ForCausalLM(LocalGlobalLM):
    hf_defaults: ClassVar[dict[str, Any]] = {
        # transformers' Gemma3TextConfig defaults: the hub's multimodal configs state few keys
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 131_072,
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}
    gguf_architectures: ClassVar[tuple[str, ...]] = ("gemma3",)
    gguf_eog_tokens: ClassVar[tuple[str, ...]] = ("<end_of_turn>",)
    qk_norm: ClassVar[bool] = True         # per-head RMSNorm of q and k (Gemma 2 has none)
    decoder_layer: ClassVar[type[nn.Module]] = Gemma3DecoderLayer    # (config, layer, backend, dtype, qk_norm)

    gguf_tensor_map: ClassVar[TensorMap] = {
        "token_embd.weight": ("embed_tokens.weight", None),
        **{f"blk.{{i}}.{g}.weight": (f"layers.{{i}}.{h}.weight", None) for h, g in _LAYER.items()},
        **{f"blk.{{i}}.{g}.weight": (f"layers.{{i}}.{ours}.weight", s) for g, ours, s in _FUSED.values()},
        "output_norm.weight": ("norm.weight", None),
        "output.weight": ("lm_head.weight", None),
    }
    hf_tensor_map: ClassVar[TensorMap] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        **{f"model.layers.{{i}}.{h}.weight": (f"layers.{{i}}.{h}.weight", None) for h in _LAYER},
        **{f"model.layers.{{i}}.{h}.weight": (f"layers.{{i}}.{ours}.weight", s)
           for h, (_, ours, s) in _FUSED.items()},
        "model.norm.weight": ("norm.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """Sliding layers by ``layer_types`` (else every SLIDING_PATTERN-th layer global), their
        own rotary base, the attention scale's query_pre_attn_scalar, ``hidden_activation``."""
        types = raw.get("layer_types") or _layer_types(raw.get("sliding_window_pattern", SLIDING_PATTERN),
                                                       fields["num_layers"])
        if raw.get("rope_parameters") is None:                       # 4.x
            local_theta = float(raw.get("rope_local_base_freq", LOCAL_ROPE_THETA))
        else:                                                          # 5.x, per layer type
            local_theta, local_scaling = rope_parameters(raw, SLIDING)
            if not local_scaling.is_default:
                raise ValueError(f"Gemma 3's sliding layers with {local_scaling.rope_type} rope scaling are not "
                                 "supported (their rope is plain)")
        # its max_position_embeddings is the scaled context already (vLLM's exception to stretching)
        window = raw.get("sliding_window")
        if raw.get("use_bidirectional_attention") and window is not None:
            window = window // 2 + 1     # transformers': a query sees keys fewer than this apart, either side
        return dict(max_model_len=raw["max_position_embeddings"], sliding_window=window, layer_types=tuple(types), rope_local_theta=local_theta,
                    query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
                    hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
                    # EmbeddingGemma's: an encoder (bidirectional attention, within the window on both sides)
                    encoder_only=bool(raw.get("use_bidirectional_attention")))

    @classmethod
    def gguf_fields(cls, keys: GGUFArchKeys, fields: dict[str, Any]) -> dict[str, Any]:
        """What llama.cpp hard-codes for gemma3 (or reads from newer keys when present)."""
        n = fields["num_layers"]
        pattern = keys.get("attention.sliding_window_pattern", SLIDING_PATTERN)
        layer_types = (tuple(SLIDING if s else FULL for s in pattern) if isinstance(pattern, list)  # True: sliding
                       else _layer_types(pattern, n))
        # llama.cpp: 27B (62 layers) scales by hidden / heads, every other size by head_size
        scalar = fields["hidden_size"] // fields["num_heads"] if n == 62 else fields["head_size"]
        return dict(
            max_model_len=keys.require("context_length"),     # the scaled context already, as in config.json
            hidden_act="gelu_pytorch_tanh",
            sliding_window=keys.require("attention.sliding_window"),
            layer_types=layer_types,
            rope_local_theta=float(keys.get("rope.freq_base_swa", LOCAL_ROPE_THETA)),
            query_pre_attn_scalar=float(scalar),
            attn_logit_softcapping=keys.get("attn_logit_softcapping"),
            final_logit_softcapping=keys.get("final_logit_softcapping"),
        )

    @classmethod
    def gguf_value_fixups(cls, config: ArchConfig) -> Fixups:
        return [("norm.weight", lambda w: w - 1.0)]    # every *norm.weight holds 1 + weight

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.rotary_dim is not None:
            raise ValueError(f"{type(self).__name__} with a partial rotary ({config.rotary_dim} of {config.head_size} "
                             "head dimensions) is not supported")
        self.build(config, dtype, lambda i: self.decoder_layer(config, i, attn_backend, dtype, self.qk_norm),
                   GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype), local=True)
        self.embed_scale = config.hidden_size ** 0.5    # applied in the model dtype, as transformers does

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' input embeddings (T,) -> (T, hidden), scaled as the layers take them (what
        vLLM's prompt embeds stand for)."""
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()                # (N, hidden) -> (N, vocab) float32
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 4B, 12B and 27B as published (a SigLIP vision tower beside the language model):
    the language model with its images (``load_vision``: transformers' SigLIP tower and Gemma 3's
    projector, read from the checkpoint; an image's positions attend to each other both ways, a
    prefix LM's), or on text alone with --language-model-only (the vision tensors never read)."""
    hf_text_config: ClassVar[str | None] = "text_config"
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = VISION_PREFIXES
    takes_images: ClassVar[bool] = True
    gguf_architectures: ClassVar[tuple[str, ...]] = ()     # llama.cpp writes the language model as "gemma3"
    hf_tensor_map: ClassVar[TensorMap] = language_model_tensor_map(Gemma3ForCausalLM.hf_tensor_map)

    def load_vision(self, path: str, overrides: dict[str, Any] | None = None) -> None:
        """The vision tower and the projector, built by transformers from the checkpoint's
        config (its SigLIP, its Gemma3MultiModalProjector) and read from its tensors (the hub's
        ``vision_tower.*`` / ``multi_modal_projector.*`` or transformers 5's ``model.``-prefixed)."""
        from models.vision import load_vision_parts
        tower, projector = load_vision_parts(path, overrides, "gemma3", self.embed_tokens.weight.dtype)
        self.vision_tower, self.multi_modal_projector = tower, projector

    def embed_multimodal(self, modality: str, data: dict[str, Any]) -> torch.Tensor:
        """One image's embeddings (its soft tokens, hidden) from its pixel values (a batch of
        one), or its embeddings as given (--enable-mm-embeds)."""
        from models.vision import image_embeddings
        return image_embeddings(self, modality, data, lambda pixels: self.multi_modal_projector(
            self.vision_tower(pixel_values=pixels).last_hidden_state))
