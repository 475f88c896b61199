"""ModernBERT (``ModernBertModel``, ``ModernBertForSequenceClassification``): an encoder with rotary
positions, pre-norm layers (LayerNorm, without a bias by default), a gated GELU MLP, and global
attention every few layers beside local layers that see a window around each token, as
transformers and vLLM run it: the rerankers and embedders of its family (gte-modernbert,
modernbert-embed) read it. Its layers attend over each prompt whole, both ways, and read no KV
cache (models/layers.py's ``encoder_attention``), so it is served as BERT is (models/bert.py)."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import TensorMap
from models.bert import EncoderLM, LayerNorm
from models.config import FULL, SLIDING, ArchConfig
from models.hf_config import rope_parameters
from models.layers import (Embedding, Linear, RotaryEmbedding, apply_rotary_qk, encoder_attention, gated_linear_act,
                           linear_residual)
from models.tensor_parallel import TPShard, column_parallel, row_parallel
from models.tp_layout import split

GLOBAL_ROPE_THETA, LOCAL_ROPE_THETA = 160_000.0, 10_000.0     # transformers' defaults


class ModernBertLayer(nn.Module):
    attention_bfloat16 = False      # models.layers.set_attention_bfloat16

    def __init__(self, config: ArchConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        c, hidden = config, config.hidden_size
        self.is_sliding = c.layer_types[layer] == SLIDING
        self.window = c.sliding_window if self.is_sliding else None
        self.num_heads, self.head_size, self.scale = c.num_heads, c.head_size, c.attn_scale
        # the first layer's input is the embeddings' norm already
        self.attn_norm = nn.Identity() if layer == 0 else LayerNorm(hidden, c.rms_norm_eps, dtype, c.norm_bias)
        self.qkv_proj = Linear(hidden, 3 * hidden, dtype, bias=c.qkv_bias)     # Wqkv, one tensor
        self.o_proj = Linear(hidden, hidden, dtype, bias=c.o_bias)
        self.mlp_norm = LayerNorm(hidden, c.rms_norm_eps, dtype, c.norm_bias)
        self.gate_up_proj = Linear(hidden, 2 * c.intermediate_size, dtype)      # Wi: input | gate
        self.down_proj = Linear(c.intermediate_size, hidden, dtype)

    def lora_slices(self) -> dict[str, dict[str, int]]:
        """The projections LoRA adapts (models/lora_layers.py), each one slice (this rank's, under
        tensor parallelism): an adapter's attn.Wqkv, attn.Wo, mlp.Wi and mlp.Wo."""
        hidden = self.mlp_norm.weight.shape[0]
        return {"qkv_proj": {"": self.qkv_proj.out_features}, "o_proj": {"": hidden},
                "gate_up_proj": {"": self.gate_up_proj.out_features}, "down_proj": {"": hidden}}

    def shard_tensor_parallel(self, world: int, rank: int, group: Any) -> None:
        """As BERT's (models/bert.py): this rank's heads, their rows of each third of Wqkv and
        columns of Wo; its run of the intermediate size, rows of each half of Wi (input, gate)
        and columns of the MLP's Wo."""
        D, hidden = self.head_size, self.mlp_norm.weight.shape[0]
        inter = self.gate_up_proj.out_features // 2
        h0, hn = split(self.num_heads, world, rank)
        i0, n = split(inter, world, rank)
        qkv = [(j * hidden + h0 * D, hn * D) for j in range(3)]
        gate_up = [(i0, n), (inter + i0, n)]
        self.qkv_proj = column_parallel(self.qkv_proj, qkv)
        self.o_proj = row_parallel(self.o_proj, (h0 * D, hn * D), rank, group)
        self.gate_up_proj = column_parallel(self.gate_up_proj, gate_up)
        self.down_proj = row_parallel(self.down_proj, (i0, n), rank, group)
        self.num_heads = hn
        self.tp_shards = {"qkv_proj": TPShard(rows={"": qkv}), "o_proj": TPShard(cols=(h0 * D, hn * D)),
                          "gate_up_proj": TPShard(rows={"": gate_up}), "down_proj": TPShard(cols=(i0, n))}

    def forward(self, hidden: torch.Tensor, starts: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = hidden.shape[0]
        q, k, v = self.qkv_proj(self.attn_norm(hidden)).view(T, 3, self.num_heads, self.head_size).unbind(1)
        q, k = apply_rotary_qk(q, k, cos, sin)
        attn = encoder_attention(q, k, v, starts, self.scale, self.window, self.attention_bfloat16)
        hidden = linear_residual(self.o_proj, attn.view(T, -1), hidden)
        # gelu(input) * gate, and the residual adds: on the CPU in the projections' own passes
        act = gated_linear_act(self.gate_up_proj, self.mlp_norm(hidden), "gelu", bfloat16_out=True)
        return linear_residual(self.down_proj, act, hidden)


def _stack_map(prefix: str) -> TensorMap:
    lay = f"{prefix}layers.{{i}}."
    names = {"attn_norm": "attn_norm", "attn.Wqkv": "qkv_proj", "attn.Wo": "o_proj", "mlp_norm": "mlp_norm",
             "mlp.Wi": "gate_up_proj", "mlp.Wo": "down_proj"}
    return {
        f"{prefix}embeddings.tok_embeddings.weight": ("embed_tokens.weight", None),
        **{f"{prefix}embeddings.norm.{p}": (f"emb_norm.{p}", None) for p in ("weight", "bias")},
        **{f"{lay}{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in names.items()
           for p in ("weight", "bias")},
        **{f"{prefix}final_norm.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
    }


class ModernBertModel(EncoderLM):
    """The encoder stack, its last hidden states after ``final_norm`` pooled (CLS by default,
    vLLM's)."""
    hf_defaults: ClassVar[dict[str, Any]] = {"rms_norm_eps": 1e-5, "intermediate_size": 1152, "local_attention": 128,
                                            "global_attn_every_n_layers": 3, "hidden_activation": "gelu",
                                            "norm_bias": False, "classifier_pooling": "cls"}
    hf_tensor_map: ClassVar[TensorMap] = {**_stack_map(""), **_stack_map("model.")}
    # a masked-LM checkpoint's prediction head and decoder; the embedding model has no head
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = ("head.", "decoder.")

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("hidden_activation", "gelu") != "gelu":
            raise ValueError(f"ModernBERT with hidden_activation {raw['hidden_activation']!r} is not supported "
                             "(gelu is)")
        every = int(raw.get("global_attn_every_n_layers") or 3)
        types = raw.get("layer_types") or [SLIDING if i % every else FULL for i in range(fields["num_layers"])]
        if raw.get("rope_parameters") is not None:        # transformers 5: one per layer type
            theta, scaling = rope_parameters(raw, FULL)
            local_theta, local_scaling = rope_parameters(raw, SLIDING)
            if not (scaling.is_default and local_scaling.is_default):
                raise ValueError("ModernBERT with rope scaling is not supported")
        else:
            theta = float(raw.get("global_rope_theta", GLOBAL_ROPE_THETA))
            local_theta = float(raw.get("local_rope_theta", LOCAL_ROPE_THETA))
        bias = bool(raw.get("attention_bias", False))
        return dict(
            rms_norm_eps=float(raw.get("norm_eps", 1e-5)), encoder_only=True, hidden_act="gelu",
            layer_types=tuple(types), rope_theta=theta, rope_local_theta=local_theta,
            # a local layer sees the keys at most local_attention // 2 positions away, either side
            sliding_window=int(raw["local_attention"]) // 2 + 1, qkv_bias=bias, o_bias=bias,
            norm_bias=bool(raw.get("norm_bias", False)), tie_word_embeddings=False, bos_token_id=None,
            eos_token_ids=())

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = config
        self.config = config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.emb_norm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_bias)
        self.rotary_global = RotaryEmbedding(c.head_size, c.rope_positions, c.rope_theta)
        self.rotary_local = RotaryEmbedding(c.head_size, c.rope_positions, c.rope_local_theta or LOCAL_ROPE_THETA)
        self.layers = nn.ModuleList(ModernBertLayer(c, i, dtype) for i in range(c.num_layers))
        self.norm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_bias)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        starts = self.prompt_starts(meta, intermediate)
        hidden = self.emb_norm(self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds)
        rope = {False: self.rotary_global(positions, hidden.dtype), True: self.rotary_local(positions, hidden.dtype)}
        for layer in self.layers:
            hidden = layer(hidden, starts, *rope[layer.is_sliding])
        return self.norm(hidden)


class _Head(nn.Module):
    """ModernBERT's classifier: its prediction head (dense, GELU, LayerNorm) over the pooled token,
    then ``classifier``; float32 (vLLM's head dtype)."""

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.dense = nn.Linear(hidden, hidden, bias=config.classifier_bias, dtype=torch.float32)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(hidden, eps=config.rms_norm_eps, bias=config.norm_bias, dtype=torch.float32)
        self.classifier = nn.Linear(hidden, config.num_labels, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(self.act(self.dense(x))))


class ModernBertForSequenceClassification(ModernBertModel):
    """A cross-encoder or classifier: the pooled token (config.json's ``classifier_pooling``, CLS or
    mean, as vLLM pools it) through the prediction head and ``classifier``."""
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = ("decoder.",)
    hf_tensor_map: ClassVar[TensorMap] = {
        **ModernBertModel.hf_tensor_map,
        **{f"head.{m}.{p}": (f"score.{m}.{p}", None) for m in ("dense", "norm") for p in ("weight", "bias")},
        **{f"classifier.{p}": (f"score.classifier.{p}", None) for p in ("weight", "bias")}}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("classifier_activation", "gelu") != "gelu":
            raise ValueError(f"ModernBERT's classifier_activation {raw['classifier_activation']!r} is not supported "
                             "(gelu is)")
        return {**super().hf_fields(raw, fields), "classifier_bias": bool(raw.get("classifier_bias", False))}

    def classifier_head(self, config: ArchConfig) -> nn.Module | None:
        return _Head(config)


class ModernBertForTokenClassification(ModernBertForSequenceClassification):
    """A token classifier: the prediction head and ``classifier`` on every token's hidden state."""


class ColBERTModernBertModel(ModernBertModel):
    """ColBERT on ModernBERT (GTE-ModernColBERT and its kin, served as vLLM serves them, with
    ``--hf-overrides '{"architectures": ["ColBERTModernBertModel"]}'``): the stack's token
    embeddings projected by the checkpoint's ``linear`` or its sentence-transformers Dense folder,
    normalized; task token_embed, scores by late interaction (as models/bert.py's HF_ColBERT)."""
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = ("head.", "decoder.", "linear.", "colbert_linear.")
