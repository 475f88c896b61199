"""Encoder-only transformers: BERT (``BertModel``, ``BertForSequenceClassification``,
``BertForTokenClassification``), RoBERTa and XLM-RoBERTa (``RobertaModel``, ``XLMRobertaModel`` and
their sequence and token classifiers), the architectures of most sentence-transformers embedding
models (all-MiniLM, bge, e5, gte), cross-encoder rerankers (ms-marco-MiniLM, bge-reranker) and NER
models; ``EncoderLM``, what they and ModernBERT (models/modernbert.py) share.

Each layer attends over its whole prompt in both directions, so a prompt is computed whole in
one step and reads no KV cache (the engine serves these models without chunked prefill or prefix
caching: vLLM's rules for bidirectional attention). Post-norm layers: LayerNorm (with bias) after
each residual add; learned absolute positions (RoBERTa's offset past its padding index) and
token types (a text pair's second segment, type 1) added to the word embeddings.

A step carries each prompt's token types inside its token ids, above ``TOKEN_TYPE_SHIFT``
(vLLM's packing: the model runner sets them from a pooling request's
``compressed_token_type_ids``, the position where type 1 starts)."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import CausalLM, TensorMap
from models.config import ArchConfig
from models.layers import (Embedding, Linear, MergedLinear, encoder_attention, hf_activation, linear_act,
                           linear_residual, whole_prompts)
from models.tensor_parallel import TPShard, column_parallel, row_parallel
from models.tp_layout import split

TOKEN_TYPE_SHIFT = 30           # a token's type in the bits of its id from here (vLLM's)


def encode_token_types(input_ids: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with each token's type (0 or 1) in its bits from TOKEN_TYPE_SHIFT."""
    return input_ids | (token_types.to(input_ids.dtype) << TOKEN_TYPE_SHIFT)


def decode_token_types(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, token types) of ids packed by ``encode_token_types``."""
    mask = 1 << TOKEN_TYPE_SHIFT
    return input_ids & (mask - 1), (input_ids & mask) >> TOKEN_TYPE_SHIFT


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension (with a bias, or without one), in float32 whatever the
    model's dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        if x.dtype == torch.float32:
            return F.layer_norm(x, self.weight.shape, self.weight.float(), bias, self.eps)
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps).to(x.dtype)


class BertLayer(nn.Module):
    """Self-attention then the feed-forward block, each followed by its residual add and
    LayerNorm (post-norm)."""
    attention_bfloat16 = False      # models.layers.set_attention_bfloat16

    def __init__(self, config: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c, hidden = config, config.hidden_size
        self.act = hf_activation(c.hidden_act, c.architecture)
        self.num_heads, self.head_size, self.scale = c.num_heads, c.head_size, c.attn_scale
        inner = c.num_heads * c.head_size
        self.qkv_proj = MergedLinear(hidden, {"q": inner, "k": inner, "v": inner}, dtype, bias=True)
        self.o_proj = Linear(inner, hidden, dtype, bias=True)
        self.attn_norm = LayerNorm(hidden, c.rms_norm_eps, dtype)
        self.up_proj = Linear(hidden, c.intermediate_size, dtype, bias=True)
        self.down_proj = Linear(c.intermediate_size, hidden, dtype, bias=True)
        self.mlp_norm = LayerNorm(hidden, c.rms_norm_eps, dtype)

    def lora_slices(self) -> dict[str, dict[str, int]]:
        """The projections LoRA adapts (models/lora_layers.py) and their outputs' slices (this
        rank's, under tensor parallelism): an adapter's query, key and value,
        attention.output.dense, intermediate.dense, output.dense."""
        inner, hidden = self.num_heads * self.head_size, self.attn_norm.weight.shape[0]
        return {"qkv_proj": {"q": inner, "k": inner, "v": inner}, "o_proj": {"": hidden},
                "up_proj": {"": self.up_proj.out_features}, "down_proj": {"": hidden}}

    def shard_tensor_parallel(self, world: int, rank: int, group: Any) -> None:
        """Megatron's split (models/tensor_parallel.py), as vLLM splits BERT: this rank's run of
        heads (their query, key and value rows; the output projection's columns) and of the
        intermediate size (up rows, down columns), an all-reduce after each block."""
        D = self.head_size
        h0, hn = split(self.num_heads, world, rank)
        i0, n = split(self.up_proj.out_features, world, rank)
        rows = {s: (h0 * D, hn * D) for s in ("q", "k", "v")}
        self.qkv_proj = column_parallel(self.qkv_proj, rows)
        self.o_proj = row_parallel(self.o_proj, (h0 * D, hn * D), rank, group)
        self.up_proj = column_parallel(self.up_proj, [(i0, n)])
        self.down_proj = row_parallel(self.down_proj, (i0, n), rank, group)
        self.num_heads = hn
        self.tp_shards = {"qkv_proj": TPShard(rows=rows), "o_proj": TPShard(cols=(h0 * D, hn * D)),
                          "up_proj": TPShard(rows={"": (i0, n)}), "down_proj": TPShard(cols=(i0, n))}

    def forward(self, x: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:   # (T, hidden)
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).view(T, 3, self.num_heads, self.head_size).unbind(1)
        attn = encoder_attention(q, k, v, query_start_loc, self.scale, bfloat16=self.attention_bfloat16).view(T, -1)
        # on the CPU the residual adds and the activation are the projections' own passes
        x = self.attn_norm(linear_residual(self.o_proj, attn, x))
        h = linear_act(self.up_proj, x, self.act, bfloat16_out=True)    # bfloat16 where the weights are
        return self.mlp_norm(linear_residual(self.down_proj, h, x))


def _encoder_map(prefix: str) -> TensorMap:
    """The tensor names of BERT's encoder stack under ``prefix`` ("" for a bare ``BertModel``)."""
    e, lay = f"{prefix}embeddings.", f"{prefix}encoder.layer.{{i}}."
    return {
        f"{e}word_embeddings.weight": ("embed_tokens.weight", None),
        f"{e}position_embeddings.weight": ("position_embeddings.weight", None),
        f"{e}token_type_embeddings.weight": ("token_type_embeddings.weight", None),
        f"{e}LayerNorm.weight": ("emb_norm.weight", None), f"{e}LayerNorm.bias": ("emb_norm.bias", None),
        **{f"{lay}attention.self.{name}.{p}": (f"layers.{{i}}.qkv_proj.{p}", s)
           for name, s in (("query", "q"), ("key", "k"), ("value", "v")) for p in ("weight", "bias")},
        **{f"{lay}{ours}.{p}": (f"layers.{{i}}.{theirs}.{p}", None) for ours, theirs in (
            ("attention.output.dense", "o_proj"), ("attention.output.LayerNorm", "attn_norm"),
            ("intermediate.dense", "up_proj"), ("output.dense", "down_proj"), ("output.LayerNorm", "mlp_norm"))
           for p in ("weight", "bias")},
    }


class EncoderLM(CausalLM):
    """What the encoder-only architectures share: no KV cache, each step's prompts whole
    (``prompt_starts``), one pipeline stage, and a classifier head of their own where they have one."""
    encoder_only: ClassVar[bool] = True
    gguf_tensor_map: ClassVar[TensorMap] = {}

    def classifier_head(self, config: ArchConfig) -> nn.Module | None:
        """The score head a classifier pools through (float32, vLLM's head dtype); None: the
        registry's plain one."""
        return None

    def prompt_starts(self, meta: AttentionMetadata, intermediate: Any) -> list[int]:
        """The step's prompt bounds (query_start_loc), each prompt whole; ValueError otherwise."""
        if intermediate is not None:
            raise ValueError(f"{type(self).__name__} runs in one pipeline stage")
        return whole_prompts(meta, type(self).__name__)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(decode_token_types(input_ids)[0])

    def embeddings(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor | None,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
        """The layers' input: the word embeddings (or ``inputs_embeds``), plus ``positions``
        (learned ones, BERT's), plus the token types' where the model has them (packed in the
        ids), through the embeddings' norm."""
        ids, types = decode_token_types(input_ids)
        hidden = self.embed_tokens(ids) if inputs_embeds is None else inputs_embeds
        if positions is not None:
            hidden = hidden + positions
        token_types = getattr(self, "token_type_embeddings", None)
        if token_types is not None:
            hidden = hidden + token_types(types)
        return self.emb_norm(hidden)


class BertModel(EncoderLM):
    """The encoder stack; its hidden states are pooled (CLS by default, a sentence-transformers
    checkpoint's own pooling where it says). Its ``pooler`` (dense + tanh over the first token)
    serves the sequence classifier only."""
    # the checkpoint's prefix of the stack: a classifier's ("bert."), or none (a bare model saved
    # alone); both read
    stack_prefix: ClassVar[str] = "bert."
    hf_defaults: ClassVar[dict[str, Any]] = {"rms_norm_eps": 1e-12, "type_vocab_size": 2, "pad_token_id": 0}
    hf_tensor_map: ClassVar[TensorMap] = {}
    hf_skipped_prefixes: ClassVar[tuple[str, ...]] = ()      # _set_maps's

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._set_maps()

    @classmethod
    def _set_maps(cls) -> None:
        head = cls.head_map()
        cls.hf_tensor_map = {**_encoder_map(""), **_encoder_map(cls.stack_prefix), **head}
        # never read: position and token type buffers some saves hold, a masked-LM head, and the
        # pooler where the head does not use it
        prefixes = ("", cls.stack_prefix)
        cls.hf_skipped_prefixes = tuple(f"{p}embeddings.{b}" for p in prefixes for b in ("position_ids",
                                                                                         "token_type_ids")) + \
            ("cls.", "lm_head.") + tuple(f"{p}pooler." for p in prefixes if not any(
                name.startswith(f"{p}pooler.") for name in head))

    @classmethod
    def head_map(cls) -> TensorMap:
        """The classifier head's tensors (``score``, when the model classifies: models/registry.py
        builds it from ``classifier_head``)."""
        return {}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{fields['architecture']}: position_embedding_type "
                             f"{raw['position_embedding_type']!r} is not supported (absolute positions are)")
        offset, positions = cls.position_offset(raw), int(raw["max_position_embeddings"])
        return dict(rms_norm_eps=float(raw.get("layer_norm_eps", 1e-12)), encoder_only=True,
                    type_vocab_size=int(raw.get("type_vocab_size") or 0), position_offset=offset,
                    max_position_embeddings=positions, max_model_len=positions - offset,
                    tie_word_embeddings=False, bos_token_id=None, eos_token_ids=())

    @classmethod
    def position_offset(cls, raw: dict[str, Any]) -> int:
        """Where a prompt's first position sits in the position table: 0 (RoBERTa's: past its
        padding index)."""
        return 0

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = config
        if c.num_kv_heads != c.num_heads:
            raise ValueError(f"{c.architecture}: every head has its own keys and values here "
                             f"({c.num_kv_heads} KV heads for {c.num_heads})")
        self.config = config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.position_embeddings = Embedding(c.max_position_embeddings or c.max_model_len + c.position_offset,
                                             c.hidden_size, dtype)
        self.token_type_embeddings = (Embedding(c.type_vocab_size, c.hidden_size, dtype)
                                      if c.type_vocab_size else None)
        self.emb_norm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(BertLayer(c, dtype) for _ in range(c.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids, positions (T,): whole prompts, each from position 0; the KV caches are unused
        starts = self.prompt_starts(meta, intermediate)
        hidden = self.embeddings(input_ids, inputs_embeds,
                                 self.position_embeddings(positions + self.config.position_offset))
        for layer in self.layers:
            hidden = layer(hidden, starts)
        return hidden


BertModel._set_maps()


class _Pooler(nn.Module):
    """BERT's pooler, then its classifier: dense + tanh over the pooled (first) token, then the
    labels' scores."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden, dtype=torch.float32)
        self.out_proj = nn.Linear(hidden, num_labels, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class BertForSequenceClassification(BertModel):
    """A cross-encoder or classifier: BERT's pooler (dense + tanh) over the CLS token, then its
    ``classifier``."""

    @classmethod
    def head_map(cls) -> TensorMap:
        return {f"{cls.stack_prefix}pooler.dense.{p}": (f"score.dense.{p}", None) for p in ("weight", "bias")} | {
            f"classifier.{p}": (f"score.out_proj.{p}", None) for p in ("weight", "bias")}

    def classifier_head(self, config: ArchConfig) -> nn.Module | None:
        return _Pooler(config.hidden_size, config.num_labels)


class HF_ColBERT(BertModel):        # noqa: N801 - the checkpoints' (and vLLM's) architecture name
    """ColBERT (colbert-ir's ``HF_ColBERT``): BERT's stack, each prompt token's hidden state
    projected by the checkpoint's ``linear`` (hidden -> its dimension, no bias) and normalized, its
    task token_embed and its scores late interaction (MaxSim), as vLLM serves it. The projection
    is the pooler's (actors/engine/pooling.py ``checkpoint_projection``), read from the file."""

    @classmethod
    def _set_maps(cls) -> None:
        super()._set_maps()
        cls.hf_skipped_prefixes += ("linear.", "colbert_linear.")


class _SpladeHead(nn.Module):
    """SPLADE's sparse embedding: BERT's masked-LM head (dense, GELU, LayerNorm, the vocabulary
    decoder, its weight the word embeddings') on each prompt token, log(1 + relu(logits)), the
    maximum over the tokens: one weight per vocabulary entry. As vLLM pools it, a first token that
    is config.json's ``cls_token_id`` and a last that is its ``sep_token_id`` are left out (none
    without those ids)."""

    def __init__(self, config: ArchConfig, embedding: nn.Parameter) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.dense = nn.Linear(hidden, hidden, dtype=torch.float32)
        self.norm = nn.LayerNorm(hidden, eps=config.rms_norm_eps, dtype=torch.float32)
        self.decoder_weight = embedding                               # tied, as BERT's masked-LM decoder is
        self.decoder_bias = nn.Parameter(torch.zeros(config.vocab_size), requires_grad=False)
        self.cls_id, self.sep_id = config.cls_token_id, config.sep_token_id

    def forward(self, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        start = 1 if self.cls_id is not None and len(token_ids) and int(token_ids[0]) == self.cls_id else 0
        end = len(rows) - 1 if self.sep_id is not None and int(token_ids[-1]) == self.sep_id else len(rows)
        if end <= start:
            return rows.new_zeros(self.decoder_weight.shape[0], dtype=torch.float32)
        x = F.gelu(self.dense(rows[start:end].float()))
        logits = F.linear(self.norm(x), self.decoder_weight.float(), self.decoder_bias)
        return torch.log1p(torch.relu(logits)).amax(0)


class BertSpladeSparseEmbeddingModel(BertModel):
    """SPLADE (naver's splade models, BERT masked-LM checkpoints, served as vLLM serves them with
    ``--hf-overrides '{"architectures": ["BertSpladeSparseEmbeddingModel"]}'``): task embed gives
    each prompt's sparse vocabulary weights (``sparse_head``; not normalized, as vLLM's), task
    token_embed its tokens' hidden states."""

    @classmethod
    def _set_maps(cls) -> None:
        super()._set_maps()
        cls.hf_skipped_prefixes = tuple(p for p in cls.hf_skipped_prefixes if p != "cls.") + \
            ("cls.seq_relationship.", "cls.predictions.decoder.weight")      # the decoder: the word embeddings

    @classmethod
    def head_map(cls) -> TensorMap:
        t = "cls.predictions.transform."
        return {**{f"{t}dense.{p}": (f"sparse_head.dense.{p}", None) for p in ("weight", "bias")},
                **{f"{t}LayerNorm.{p}": (f"sparse_head.norm.{p}", None) for p in ("weight", "bias")},
                "cls.predictions.bias": ("sparse_head.decoder_bias", None),
                "cls.predictions.decoder.bias": ("sparse_head.decoder_bias", None)}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {**super().hf_fields(raw, fields), "cls_token_id": raw.get("cls_token_id"),
                "sep_token_id": raw.get("sep_token_id")}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        self.sparse_head = _SpladeHead(config, self.embed_tokens.weight)


class RobertaModel(BertModel):
    """RoBERTa: BERT's stack with positions counted from its padding index + 1."""
    stack_prefix: ClassVar[str] = "roberta."
    hf_defaults: ClassVar[dict[str, Any]] = {"rms_norm_eps": 1e-5, "type_vocab_size": 1, "pad_token_id": 1}

    @classmethod
    def position_offset(cls, raw: dict[str, Any]) -> int:
        return int(raw.get("pad_token_id", 1)) + 1


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa's classifier head: dense + tanh over the first token, then ``out_proj``."""

    @classmethod
    def head_map(cls) -> TensorMap:
        return {f"classifier.{name}.{p}": (f"score.{name}.{p}", None)
                for name in ("dense", "out_proj") for p in ("weight", "bias")}

    def classifier_head(self, config: ArchConfig) -> nn.Module | None:
        return _Pooler(config.hidden_size, config.num_labels)


class RobertaForMaskedLM(RobertaModel):
    """A RoBERTa masked-LM checkpoint served as vLLM serves it: its stack's embeddings (CLS by
    default), the LM head not read."""


class XLMRobertaModel(RobertaModel):
    pass


class BgeM3EmbeddingModel(XLMRobertaModel):
    """BGE-M3 (an XLMRobertaModel checkpoint, served as vLLM serves it with ``--hf-overrides
    '{"architectures": ["BgeM3EmbeddingModel"]}'``): XLM-RoBERTa's stack; its multi-vector and
    lexical heads, colbert_linear.pt and sparse_linear.pt beside the checkpoint, are the pooler's
    (actors/engine/pooling.py ``bge_m3_heads``)."""


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    pass


class _TokenClassifier(nn.Module):
    """A token classifier's head: ``classifier`` (hidden -> labels, with a bias) on every token."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.out_proj = nn.Linear(hidden, num_labels, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(x)


class BertForTokenClassification(BertModel):
    """A token classifier (NER and the like): ``classifier`` on every token's hidden state."""

    @classmethod
    def head_map(cls) -> TensorMap:
        return {f"classifier.{p}": (f"score.out_proj.{p}", None) for p in ("weight", "bias")}

    def classifier_head(self, config: ArchConfig) -> nn.Module | None:
        return _TokenClassifier(config.hidden_size, config.num_labels)


class RobertaForTokenClassification(RobertaModel):
    head_map = BertForTokenClassification.head_map
    classifier_head = BertForTokenClassification.classifier_head


class XLMRobertaForTokenClassification(RobertaForTokenClassification):
    pass
