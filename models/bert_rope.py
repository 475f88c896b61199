"""BERT with rotary positions, vLLM's bert_with_rope models: nomic-bert (``NomicBertModel``: the
nomic-embed-text models), Alibaba's GTE v1.5 (``GteNewModel``: the gte-*-en-v1.5 checkpoints, whose
config.json says ``NewModel``, served as vLLM serves them with ``--hf-overrides
'{"architectures": ["GteNewModel"]}'``; and ``GteNewForSequenceClassification``, its rerankers) and
Snowflake's arctic-embed v2 (``GteModel``).

BERT's post-norm layers (models/bert.py), with a rotary on each head's queries and keys in place
of learned positions (NeoX style, over a share of the head where the config says, with GTE's
fixed NTK scaling where it has it), the queries, keys and values in one tensor, and a gated MLP:
SwiGLU for nomic (``fc12`` the gate, ``fc11`` the value), GeGLU for GTE (``up_gate_proj``, the
value rows then the gate's), or nomic-bert-2048's plain GELU one (``fc1``, ``fc2``). Token types
as BERT's (a text pair's second segment) where the model has them. No final norm."""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import TensorMap
from models.bert import EncoderLM, LayerNorm, _Pooler
from models.config import ArchConfig
from models.layers import (Embedding, Linear, MergedLinear, RotaryEmbedding, apply_rotary_qk, encoder_attention,
                           gated_linear_act, linear_act, linear_residual)
from models.tensor_parallel import TPShard, column_parallel, row_parallel
from models.tp_layout import split


class BertWithRopeLayer(nn.Module):
    """attention (q|k|v in one tensor, rotary, whole prompts both ways) + residual, LayerNorm; MLP
    + residual, LayerNorm."""
    attention_bfloat16 = False      # models.layers.set_attention_bfloat16

    def __init__(self, config: ArchConfig, dtype: torch.dtype, up_bias: bool, down_bias: bool) -> None:
        super().__init__()
        c, hidden, inter = config, config.hidden_size, config.intermediate_size
        self.num_heads, self.head_size, self.scale = c.num_heads, c.head_size, c.attn_scale
        self.qkv_proj = Linear(hidden, 3 * hidden, dtype, bias=c.qkv_bias)
        self.o_proj = Linear(hidden, hidden, dtype, bias=c.o_bias)
        self.attn_norm = LayerNorm(hidden, c.rms_norm_eps, dtype)
        # a gated MLP's activation (SwiGLU: silu, GeGLU: gelu) on the gate, times the value
        self.gated = c.hidden_act in ("silu", "geglu")
        self.act = {"geglu": "gelu"}.get(c.hidden_act, c.hidden_act)
        if self.gated:
            self.gate_up_proj = MergedLinear(hidden, {"gate": inter, "up": inter}, dtype, bias=up_bias)
        else:
            self.up_proj = Linear(hidden, inter, dtype, bias=up_bias)
        self.down_proj = Linear(inter, hidden, dtype, bias=down_bias)
        self.mlp_norm = LayerNorm(hidden, c.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, starts: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).view(T, 3, self.num_heads, self.head_size).unbind(1)
        q, k = apply_rotary_qk(q, k, cos, sin)
        attn = encoder_attention(q, k, v, starts, self.scale, bfloat16=self.attention_bfloat16)
        x = self.attn_norm(linear_residual(self.o_proj, attn.reshape(T, -1), x))
        if self.gated:
            h = gated_linear_act(self.gate_up_proj, x, self.act, bfloat16_out=True)
        else:
            h = linear_act(self.up_proj, x, self.act, bfloat16_out=True)
        return self.mlp_norm(linear_residual(self.down_proj, h, x))

    def shard_tensor_parallel(self, world: int, rank: int, group: Any) -> None:
        """As ModernBERT's (models/modernbert.py): this rank's heads (their rows of each third of
        q|k|v, the output projection's columns) and run of the intermediate size."""
        D, hidden = self.head_size, self.attn_norm.weight.shape[0]
        up = self.gate_up_proj if self.gated else self.up_proj
        inter = up.out_features // (2 if self.gated else 1)
        h0, hn = split(self.num_heads, world, rank)
        i0, n = split(inter, world, rank)
        qkv = [(j * hidden + h0 * D, hn * D) for j in range(3)]
        self.qkv_proj = column_parallel(self.qkv_proj, qkv)
        self.o_proj = row_parallel(self.o_proj, (h0 * D, hn * D), rank, group)
        if self.gated:
            self.gate_up_proj = column_parallel(self.gate_up_proj, {"gate": (i0, n), "up": (i0, n)})
        else:
            self.up_proj = column_parallel(self.up_proj, [(i0, n)])
        self.down_proj = row_parallel(self.down_proj, (i0, n), rank, group)
        self.num_heads = hn
        self.tp_shards = {"qkv_proj": TPShard(rows={"": qkv}), "o_proj": TPShard(cols=(h0 * D, hn * D)),
                          "down_proj": TPShard(cols=(i0, n))}


class BertWithRope(EncoderLM):
    """The stack: word (and token type) embeddings and their LayerNorm, then the layers; pooled
    (CLS by default, vLLM's; a sentence-transformers checkpoint's own pooling where it says)."""
    hf_defaults: ClassVar[dict[str, Any]] = {"rms_norm_eps": 1e-12, "type_vocab_size": 0}
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def mlp_biases(cls, config: ArchConfig) -> tuple[bool, bool]:
        """(gate|up or up, down) projections' biases: those of the attention's here (nomic's one
        ``bias``)."""
        return config.qkv_bias, config.qkv_bias

    @classmethod
    def _check(cls, raw: dict[str, Any]) -> None:
        """ValueError for a config of this family whose layers are not these."""
        kind = raw.get("position_embedding_type", "rope")
        if kind not in ("rope", "rotary"):
            raise ValueError(f"{raw['architectures'][0]}: position_embedding_type {kind!r} is not supported "
                             "(rotary positions are)")

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        cls._check(raw)
        return dict(rms_norm_eps=float(raw.get("layer_norm_eps", 1e-12)), encoder_only=True,
                    type_vocab_size=int(raw.get("type_vocab_size") or 0), tie_word_embeddings=False,
                    bos_token_id=None, eos_token_ids=())

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = config
        if c.num_kv_heads != c.num_heads or c.num_heads * c.head_size != c.hidden_size:
            raise ValueError(f"{c.architecture}: each of the {c.num_heads} heads has its own keys and values, "
                             f"hidden_size {c.hidden_size} split between them")
        self.config = config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.token_type_embeddings = (Embedding(c.type_vocab_size, c.hidden_size, dtype)
                                      if c.type_vocab_size else None)
        self.emb_norm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(c.rotary_dim or c.head_size, c.rope_positions, c.rope_theta, c.rope_scaling,
                                      c.serving_len)
        up_bias, down_bias = self.mlp_biases(c)
        self.layers = nn.ModuleList(BertWithRopeLayer(c, dtype, up_bias, down_bias) for _ in range(c.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        starts = self.prompt_starts(meta, intermediate)
        hidden = self.embeddings(input_ids, inputs_embeds)
        cos, sin = self.rotary(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, starts, cos, sin)
        return hidden


def _nomic_map(prefix: str) -> TensorMap:
    lay = f"{prefix}encoder.layers.{{i}}."
    names = {"attn.Wqkv": "qkv_proj", "attn.out_proj": "o_proj", "norm1": "attn_norm", "mlp.fc1": "up_proj",
             "mlp.fc2": "down_proj", "norm2": "mlp_norm"}
    return {
        f"{prefix}embeddings.word_embeddings.weight": ("embed_tokens.weight", None),
        f"{prefix}embeddings.token_type_embeddings.weight": ("token_type_embeddings.weight", None),
        **{f"{prefix}emb_ln.{p}": (f"emb_norm.{p}", None) for p in ("weight", "bias")},
        **{f"{lay}{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in names.items()
           for p in ("weight", "bias")},
        **{f"{lay}mlp.{theirs}.{p}": (f"layers.{{i}}.gate_up_proj.{p}", shard)
           for theirs, shard in (("fc12", "gate"), ("fc11", "up")) for p in ("weight", "bias")},
    }


class NomicBertModel(BertWithRope):
    """nomic-bert: config.json in GPT-2's names (n_embd, n_head, n_inner, n_layer, n_positions),
    ``activation_function`` swiglu (a gated SiLU MLP) or gelu, one ``qkv_proj_bias`` for every
    projection, ``rotary_emb_base`` and ``rotary_emb_fraction``."""
    hf_tensor_map: ClassVar[TensorMap] = {**_nomic_map(""), **_nomic_map("model.")}

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        raw = dict(raw)
        for theirs, ours in (("n_embd", "hidden_size"), ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers"),
                             ("n_inner", "intermediate_size"), ("layer_norm_epsilon", "layer_norm_eps"),
                             ("rotary_emb_base", "rope_theta"), ("n_positions", "max_position_embeddings")):
            if raw.get(ours) is None and raw.get(theirs) is not None:
                raw[ours] = raw[theirs]
        if raw.get("intermediate_size") is None and raw.get("hidden_size") is not None:
            raw["intermediate_size"] = 4 * raw["hidden_size"]
        raw.setdefault("max_position_embeddings", 2048)
        raw.setdefault("rms_norm_eps", raw.get("layer_norm_eps", 1e-12))
        if raw.get("max_trained_positions") is not None:     # what dynamic NTK scaling counts from (vLLM's)
            raw.setdefault("original_max_position_embeddings", raw["max_trained_positions"])
        return raw

    @classmethod
    def _check(cls, raw: dict[str, Any]) -> None:
        super()._check(raw)
        act = raw.get("activation_function", "gelu")
        problems = [what for what, bad in (
            (f"activation_function {act!r} (swiglu and gelu are supported)", act not in ("swiglu", "gelu")),
            ("a mixture-of-experts MLP (moe_every_n_layers)", bool(raw.get("moe_every_n_layers"))),
            ("prenorm layers", bool(raw.get("prenorm"))), ("parallel blocks", bool(raw.get("parallel_block"))),
            ("RMS norms", bool(raw.get("use_rms_norm"))), ("causal attention", bool(raw.get("causal"))),
            ("an interleaved rotary", bool(raw.get("rotary_emb_interleaved"))),
            ("rotary_emb_scale_base", raw.get("rotary_emb_scale_base") is not None),
            ("MLP biases unlike qkv_proj_bias", not raw.get("mlp_fc1_bias", True) == raw.get("mlp_fc2_bias", True)
             == raw.get("qkv_proj_bias", True))) if bad]
        if problems:
            raise ValueError(f"NomicBertModel with {', '.join(problems)} is not supported")

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        bias = bool(raw.get("qkv_proj_bias", True))
        act = "silu" if raw.get("activation_function", "gelu") == "swiglu" else "gelu"
        return {**super().hf_fields(raw, fields), "qkv_bias": bias, "o_bias": bias, "hidden_act": act}


def _gte_map(prefix: str) -> TensorMap:
    lay = f"{prefix}encoder.layer.{{i}}."
    names = {"attention.qkv_proj": "qkv_proj", "attention.o_proj": "o_proj", "attn_ln": "attn_norm",
             "mlp.down_proj": "down_proj", "mlp_ln": "mlp_norm"}
    e = f"{prefix}embeddings."
    return {
        f"{e}word_embeddings.weight": ("embed_tokens.weight", None),
        f"{e}token_type_embeddings.weight": ("token_type_embeddings.weight", None),
        **{f"{e}LayerNorm.{p}": (f"emb_norm.{p}", None) for p in ("weight", "bias")},
        **{f"{lay}{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in names.items()
           for p in ("weight", "bias")},
        # up_gate_proj, split by hf_weights: the value rows, then the gate's
        **{f"{lay}mlp.{part}_proj.weight": ("layers.{i}.gate_up_proj.weight", part) for part in ("gate", "up")},
    }


class GteNewModel(BertWithRope):
    """GTE v1.5 (Alibaba's "new" implementation): BERT's names, q|k|v and the MLP's value|gate
    rows each in one tensor (no bias on the latter), GELU gating, rope_theta and NTK scaling."""
    hf_tensor_map: ClassVar[TensorMap] = {**_gte_map(""), **_gte_map("new.")}
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = ("embeddings.position_ids", "new.embeddings.position_ids",
                                                      "pooler.", "new.pooler.", "classifier.")

    @classmethod
    def mlp_biases(cls, config: ArchConfig) -> tuple[bool, bool]:
        return False, config.qkv_bias

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{fields['architecture']} with hidden_act {raw['hidden_act']!r} is not supported "
                             "(gelu, gating the MLP, is)")
        if raw.get("layer_norm_type", "layer_norm") != "layer_norm" or raw.get("logn_attention_scale"):
            raise ValueError(f"{fields['architecture']} with {raw.get('layer_norm_type')} norms or a log-n attention "
                             "scale is not supported")
        bias = bool(raw.get("bias", True))
        return {**super().hf_fields(raw, fields), "qkv_bias": bias, "o_bias": bias, "hidden_act": "geglu"}

    def hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith("mlp.up_gate_proj.weight"):       # value rows, then gate rows
                up, gate = tensor.chunk(2, dim=0)
                yield name.replace("up_gate_proj", "up_proj"), up
                yield name.replace("up_gate_proj", "gate_proj"), gate
            else:
                yield name, tensor


class GteModel(GteNewModel):
    """Snowflake's arctic-embed v2 (``GteModel``, vLLM's SnowflakeGteNewModel): GTE's layers,
    saved without the ``new.`` prefix."""


class GteNewForSequenceClassification(GteNewModel):
    """GTE's reranker: BERT's pooler (dense + tanh) over the CLS token, then ``classifier``."""
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = ("embeddings.position_ids", "new.embeddings.position_ids")
    hf_tensor_map: ClassVar[TensorMap] = {
        **GteNewModel.hf_tensor_map,
        **{f"{prefix}pooler.dense.{p}": (f"score.dense.{p}", None) for prefix in ("", "new.") for p in ("weight", "bias")},
        **{f"classifier.{p}": (f"score.out_proj.{p}", None) for p in ("weight", "bias")}}

    def classifier_head(self, config: ArchConfig) -> nn.Module | None:
        return _Pooler(config.hidden_size, config.num_labels)
