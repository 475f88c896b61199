"""Decoders with LayerNorms (weight and bias) and an ungated GELU MLP, biases throughout:
StarCoder2 (``Starcoder2ForCausalLM``: Llama's order of sublayers, norm, attention, add; norm, MLP,
add; one sliding window for every layer where the config sets one), Phi-2 (``PhiForCausalLM``: a
parallel block, one norm read by attention and the MLP, both added to the stream; a rotary over
a share of each head; an LM head with a bias), GPT-NeoX (``GPTNeoXForCausalLM``, Pythia: a
parallel block with a norm for each side, or Llama's order, its q|k|v rows head by head in the
checkpoint, put in the fused projection's order at load), GPT-2 (``GPT2LMHeadModel``: learned
positions and no rotary, its projections stored transposed, as Conv1D holds them) and OPT
(``OPTForCausalLM``: GPT-2's shape with its positions offset by 2 and a ReLU MLP; OPT-350m's norms
after each sublayer's add and its embeddings projected in and out of a narrower size), and StableLM
(``StableLmForCausalLM``: LayerNorms around a SiLU-gated MLP, a quarter of each head turning), and
BLOOM (``BloomForCausalLM``: ALiBi's biases for positions, its embeddings normalized), MPT
(``MptForCausalLM``: ALiBi, no biases), GPT-BigCode (``GPTBigCodeForCausalLM``: GPT-2 with one
key/value head), Falcon (``FalconForCausalLM``) and GPT-J (``GPTJForCausalLM``: a parallel block,
an interleaved rotary over part of each head)."""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.base import TensorMap
from models.bert import LayerNorm
from models.config import ArchConfig
from models.gemma3 import LocalGlobalLM
from models.layers import MLP, Embedding, GatedMLP, Linear, SelfAttention, hf_activation
from models.rope import interleaved_to_half_split


SEQUENTIAL, PARALLEL, PARALLEL_TWO_NORMS, POST_NORM = "sequential", "parallel", "parallel, two norms", "post-norm"
_NEOX_BUFFERS = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq")


class _Layer(nn.Module):
    is_sliding = False          # one rotary table for every layer

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 block: str) -> None:
        super().__init__()
        c = config
        self.block = block
        self.input_layernorm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype, bias=c.norm_bias)
        self.self_attn = SelfAttention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, backend, dtype, scale=c.attn_scale,
            sliding_window=c.layer_sliding_window(layer), qkv_bias=c.qkv_bias, o_bias=c.o_bias,
            rotary_dim=c.rotary_dim, use_rope=c.layer_uses_rope(layer), alibi_bias_max=c.alibi_bias_max)
        if block != PARALLEL:
            self.post_attention_layernorm = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype, bias=c.norm_bias)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, hf_activation(c.hidden_act, c.architecture), dtype,
                       bias=c.o_bias)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.block == POST_NORM:         # each norm after its sublayer's add (OPT-350m)
            hidden = self.input_layernorm(hidden + self.self_attn(hidden, cos, sin, kv_cache, meta))
            return self.post_attention_layernorm(hidden + self.mlp(hidden))
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(normed, cos, sin, kv_cache, meta)
        if self.block == PARALLEL:
            return hidden + attn + self.mlp(normed)
        if self.block == PARALLEL_TWO_NORMS:
            return hidden + attn + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _layer_map(names: dict[str, str]) -> TensorMap:
    return {f"model.layers.{{i}}.{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in names.items()
            for p in ("weight", "bias")}


class Starcoder2ForCausalLM(LocalGlobalLM):
    block: ClassVar[str] = SEQUENTIAL
    hf_defaults: ClassVar[dict[str, Any]] = {"norm_epsilon": 1e-5, "use_bias": True, "hidden_act": "gelu_pytorch_tanh",
                                             "tie_word_embeddings": True}
    hf_tensor_map: ClassVar[TensorMap] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        **{f"model.layers.{{i}}.self_attn.{s}_proj.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", s)
           for s in "qkv" for p in ("weight", "bias")},
        **_layer_map({"input_layernorm": "input_layernorm", "self_attn.o_proj": "self_attn.o_proj",
                      "post_attention_layernorm": "post_attention_layernorm", "mlp.c_fc": "mlp.up_proj",
                      "mlp.c_proj": "mlp.down_proj"}),
        **{f"model.norm.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
        "lm_head.weight": ("lm_head.weight", None),
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "rms_norm_eps": raw["norm_epsilon"]}        # its LayerNorms' epsilon

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        bias = bool(raw["use_bias"])
        return {"qkv_bias": bias, "o_bias": bias, "sliding_window": raw.get("sliding_window")}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        block = self.layer_block(config)
        self.build(config, dtype, lambda i: _Layer(config, i, attn_backend, dtype, block),
                   LayerNorm(config.hidden_size, config.rms_norm_eps, dtype, bias=config.norm_bias), local=False,
                   lm_head_bias=self.lm_head_bias)

    lm_head_bias: ClassVar[bool] = False

    def layer_block(self, config: ArchConfig) -> str:
        """How each layer adds its sublayers (SEQUENTIAL, PARALLEL, PARALLEL_TWO_NORMS)."""
        return self.block

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class PhiForCausalLM(Starcoder2ForCausalLM):
    """Phi-2 (and Phi-1.5): a parallel block, ``partial_rotary_factor`` of each head turning, the
    output projection named ``dense``, the MLP ``fc1``/``fc2``, the final norm ``final_layernorm``,
    an LM head with a bias."""
    block: ClassVar[str] = PARALLEL
    lm_head_bias: ClassVar[bool] = True
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_eps": 1e-5, "hidden_act": "gelu_new",
                                             "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
                                             "qk_layernorm": False}
    hf_tensor_map: ClassVar[TensorMap] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        **{f"model.layers.{{i}}.self_attn.{s}_proj.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", s)
           for s in "qkv" for p in ("weight", "bias")},
        **_layer_map({"input_layernorm": "input_layernorm", "self_attn.dense": "self_attn.o_proj",
                      "mlp.fc1": "mlp.up_proj", "mlp.fc2": "mlp.down_proj"}),
        **{f"model.final_layernorm.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
        **{f"lm_head.{p}": (f"lm_head.{p}", None) for p in ("weight", "bias")},
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "rms_norm_eps": raw["layer_norm_eps"]}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("qk_layernorm"):
            raise ValueError("PhiForCausalLM with qk_layernorm is not supported")
        return {"qkv_bias": True, "o_bias": True, "sliding_window": None}


class GPTNeoXForCausalLM(Starcoder2ForCausalLM):
    """GPT-NeoX (Pythia): ``use_parallel_residual`` (the default) adds attention of one norm and the
    MLP of another to the stream together; otherwise Llama's order. ``rotary_pct`` of each head
    turns (half-split, NeoX's own style)."""
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_eps": 1e-5, "hidden_act": "gelu", "rotary_pct": 0.25,
                                             "rotary_emb_base": 10_000, "tie_word_embeddings": False,
                                             "use_parallel_residual": True, "attention_bias": True}
    hf_tensor_map: ClassVar[TensorMap] = {
        "gpt_neox.embed_in.weight": ("embed_tokens.weight", None),
        **{f"gpt_neox.layers.{{i}}.attention.query_key_value.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", None)
           for p in ("weight", "bias")},
        **{f"gpt_neox.layers.{{i}}.{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in (
            ("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_attention_layernorm"),
            ("attention.dense", "self_attn.o_proj"), ("mlp.dense_h_to_4h", "mlp.up_proj"),
            ("mlp.dense_4h_to_h", "mlp.down_proj")) for p in ("weight", "bias")},
        **{f"gpt_neox.final_layer_norm.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
        "embed_out.weight": ("lm_head.weight", None),
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        out = {**raw, "rms_norm_eps": raw["layer_norm_eps"], "rope_theta": raw.get("rope_theta", raw["rotary_emb_base"])}
        if raw.get("rope_parameters") is None and "partial_rotary_factor" not in raw:
            out["partial_rotary_factor"] = raw["rotary_pct"]
        return out

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        bias = bool(raw["attention_bias"])
        return {"qkv_bias": bias, "o_bias": bias, "sliding_window": None,
                "parallel_residual": bool(raw["use_parallel_residual"])}

    def layer_block(self, config: ArchConfig) -> str:
        return PARALLEL_TWO_NORMS if config.parallel_residual else SEQUENTIAL

    def hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        # older saves hold the attention's causal mask and rotary frequencies as buffers: not weights
        kept = ((n, t) for n, t in weights if not n.endswith(_NEOX_BUFFERS))
        return super().hf_weights(kept)

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(("attention.query_key_value.weight", "attention.query_key_value.bias")):
            return _qkv_by_part(tensor, self.config)
        return tensor


def _qkv_by_part(tensor: torch.Tensor, config: ArchConfig) -> torch.Tensor:
    """A fused q|k|v tensor whose rows go head by head, (H, 3, D) (GPT-NeoX's, BLOOM's), in the
    fused projection's order, (3, H, D)."""
    D, H = config.head_size, config.num_heads
    return tensor.reshape(H, 3, D, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


_GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _gpt2_map(prefix: str) -> TensorMap:
    lay = f"{prefix}h.{{i}}."
    return {
        f"{prefix}wte.weight": ("embed_tokens.weight", None),
        f"{prefix}wpe.weight": ("position_embeddings.weight", None),
        **{f"{lay}{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in (
            ("ln_1", "input_layernorm"), ("attn.c_attn", "self_attn.qkv_proj"), ("attn.c_proj", "self_attn.o_proj"),
            ("ln_2", "post_attention_layernorm"), ("mlp.c_fc", "mlp.up_proj"), ("mlp.c_proj", "mlp.down_proj"))
           for p in ("weight", "bias")},
        **{f"{prefix}ln_f.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
    }


class GPT2LMHeadModel(Starcoder2ForCausalLM):
    """GPT-2: learned absolute positions added to the token embeddings, no rotary, Llama's order of
    sublayers with LayerNorms, the GELU (tanh) MLP, a tied head; config.json in its own names
    (n_embd, n_head, n_layer, n_positions, n_inner, layer_norm_epsilon, activation_function)."""
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
                                             "tie_word_embeddings": True, "n_inner": None,
                                             "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                                             "reorder_and_upcast_attn": False}
    hf_tensor_map: ClassVar[TensorMap] = {**_gpt2_map(""), **_gpt2_map("transformer."),
                                          "lm_head.weight": ("lm_head.weight", None)}

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        hidden = raw["n_embd"]
        return {**raw, "hidden_size": hidden, "num_attention_heads": raw["n_head"], "num_hidden_layers": raw["n_layer"],
                "intermediate_size": raw["n_inner"] or 4 * hidden, "max_position_embeddings": raw["n_positions"],
                "rms_norm_eps": raw["layer_norm_epsilon"], "hidden_act": raw["activation_function"]}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        odd = [k for k, bad in (("scale_attn_weights false", not raw["scale_attn_weights"]),
                                ("scale_attn_by_inverse_layer_idx", raw["scale_attn_by_inverse_layer_idx"]),
                                ("reorder_and_upcast_attn", raw["reorder_and_upcast_attn"])) if bad]
        if odd:
            raise ValueError(f"GPT2LMHeadModel with {', '.join(odd)} is not supported")
        return {"qkv_bias": True, "o_bias": True, "sliding_window": None, "max_position_embeddings": raw["n_positions"],
                "rope_layers": (False,) * fields["num_layers"]}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size, dtype)

    def input_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        rows = positions + self.config.position_offset if self.config.position_offset else positions
        return super().input_hidden(input_ids, positions, inputs_embeds) + self.position_embeddings(rows)

    def hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(_GPT2_BUFFERS):            # the attention's mask, in older saves: not a weight
                continue
            yield name, (tensor.t() if name.endswith(_GPT2_CONV1D) else tensor)     # Conv1D's (in, out)


def _opt_map(prefix: str) -> TensorMap:
    lay = f"{prefix}layers.{{i}}."
    return {
        f"{prefix}embed_tokens.weight": ("embed_tokens.weight", None),
        f"{prefix}embed_positions.weight": ("position_embeddings.weight", None),
        f"{prefix}project_in.weight": ("project_in.weight", None),
        f"{prefix}project_out.weight": ("project_out.weight", None),
        **{f"{lay}self_attn.{s}_proj.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", s)
           for s in "qkv" for p in ("weight", "bias")},
        **{f"{lay}{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in (
            ("self_attn_layer_norm", "input_layernorm"), ("self_attn.out_proj", "self_attn.o_proj"),
            ("final_layer_norm", "post_attention_layernorm"), ("fc1", "mlp.up_proj"), ("fc2", "mlp.down_proj"))
           for p in ("weight", "bias")},
        **{f"{prefix}final_layer_norm.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
    }


class OPTForCausalLM(GPT2LMHeadModel):
    """OPT (facebook/opt-125m to 66b): learned positions read 2 rows on (``position_offset``), q, k
    and v apart, ``ffn_dim`` ReLU MLPs, a tied head. ``do_layer_norm_before`` false (OPT-350m): each
    norm after its sublayer's add, no final norm; ``word_embed_proj_dim`` below the hidden size
    (350m too): the embeddings projected in to the hidden size and the last hidden states out."""
    hf_defaults: ClassVar[dict[str, Any]] = {"activation_function": "relu", "do_layer_norm_before": True,
                                             "enable_bias": True, "layer_norm_elementwise_affine": True,
                                             "tie_word_embeddings": True, "_remove_final_layer_norm": False,
                                             "word_embed_proj_dim": None}
    hf_tensor_map: ClassVar[TensorMap] = {**_opt_map("model.decoder."), **_opt_map("decoder."),
                                          "lm_head.weight": ("lm_head.weight", None)}

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "intermediate_size": raw["ffn_dim"], "rms_norm_eps": 1e-5,
                "hidden_act": raw["activation_function"]}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if not raw["enable_bias"] or not raw["layer_norm_elementwise_affine"]:
            raise ValueError("OPTForCausalLM without biases or with norms that have no weights is not supported")
        if raw["_remove_final_layer_norm"] and raw["do_layer_norm_before"]:
            raise ValueError("OPTForCausalLM with _remove_final_layer_norm is not supported")
        width = raw["word_embed_proj_dim"]
        return {"qkv_bias": True, "o_bias": True, "sliding_window": None, "position_offset": 2,
                "max_position_embeddings": raw["max_position_embeddings"] + 2,
                "rope_layers": (False,) * fields["num_layers"],
                "post_norm": not raw["do_layer_norm_before"],
                "embedding_size": 0 if width in (None, fields["hidden_size"]) else width}

    def layer_block(self, config: ArchConfig) -> str:
        return POST_NORM if config.post_norm else SEQUENTIAL

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        c = config
        if c.post_norm:
            self.norm = nn.Identity()
        if c.embedding_size:                # token embeddings narrower than the hidden size
            self.embed_tokens = Embedding(c.vocab_size, c.embedding_size, dtype)
            self.project_in = Linear(c.embedding_size, c.hidden_size, dtype)
            self.project_out = Linear(c.hidden_size, c.embedding_size, dtype)
            tied = self.embed_tokens.weight if c.tie_word_embeddings else None
            self.lm_head = Linear(c.embedding_size, c.vocab_size, dtype, weight=tied)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return self.project_in(hidden) if self.config.embedding_size else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.embedding_size:
            hidden = self.project_out(hidden)
        return self.lm_head(hidden).float()


class _StableLmLayer(_Layer):
    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 block: str) -> None:
        super().__init__(config, layer, backend, dtype, block)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, dtype)


class StableLmForCausalLM(Starcoder2ForCausalLM):
    """StableLM (stablelm-3b-4e1t, StableLM 2 1.6B, Zephyr): LayerNorms with biases around a
    SiLU-gated MLP without them, q/k/v biases where ``use_qkv_bias``, a rotary over the leading
    quarter of each head (``partial_rotary_factor``), Llama's order of sublayers or, with
    ``use_parallel_residual``, attention and the MLP both of one norm. Its per-head q/k LayerNorms
    (``qk_layernorm``, StableLM 2 12B) are refused by name."""
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_eps": 1e-5, "use_qkv_bias": False, "qk_layernorm": False,
                                             "use_parallel_residual": False, "partial_rotary_factor": 0.25,
                                             "tie_word_embeddings": False, "hidden_act": "silu"}
    hf_tensor_map: ClassVar[TensorMap] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None),
        **{f"model.layers.{{i}}.self_attn.{s}_proj.{p}": (f"layers.{{i}}.self_attn.qkv_proj.{p}", s)
           for s in "qkv" for p in ("weight", "bias")},
        **_layer_map({"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}),
        "model.layers.{i}.self_attn.o_proj.weight": ("layers.{i}.self_attn.o_proj.weight", None),
        "model.layers.{i}.mlp.gate_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", "gate"),
        "model.layers.{i}.mlp.up_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", "up"),
        "model.layers.{i}.mlp.down_proj.weight": ("layers.{i}.mlp.down_proj.weight", None),
        **{f"model.norm.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
        "lm_head.weight": ("lm_head.weight", None),
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "rms_norm_eps": raw["layer_norm_eps"]}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw["qk_layernorm"]:
            raise ValueError("StableLmForCausalLM with qk_layernorm (per-head q/k LayerNorms) is not supported")
        return {"qkv_bias": bool(raw["use_qkv_bias"]), "o_bias": False, "sliding_window": None,
                "parallel_residual": bool(raw["use_parallel_residual"])}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        LocalGlobalLM.__init__(self)
        block = PARALLEL if config.parallel_residual else SEQUENTIAL
        self.build(config, dtype, lambda i: _StableLmLayer(config, i, attn_backend, dtype, block),
                   LayerNorm(config.hidden_size, config.rms_norm_eps, dtype), local=False)


def _bloom_map(prefix: str) -> TensorMap:
    lay = f"{prefix}h.{{i}}."
    return {
        f"{prefix}word_embeddings.weight": ("embed_tokens.weight", None),
        **{f"{prefix}word_embeddings_layernorm.{p}": (f"embed_norm.{p}", None) for p in ("weight", "bias")},
        **{f"{lay}{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in (
            ("input_layernorm", "input_layernorm"), ("self_attention.query_key_value", "self_attn.qkv_proj"),
            ("self_attention.dense", "self_attn.o_proj"), ("post_attention_layernorm", "post_attention_layernorm"),
            ("mlp.dense_h_to_4h", "mlp.up_proj"), ("mlp.dense_4h_to_h", "mlp.down_proj")) for p in ("weight", "bias")},
        **{f"{prefix}ln_f.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
    }


class BloomForCausalLM(Starcoder2ForCausalLM):
    """BLOOM (bigscience/bloom-560m to 176b, BLOOMZ): ALiBi's distance biases in place of positions,
    a LayerNorm on the token embeddings, Llama's order of sublayers with LayerNorms, a 4x GELU
    (tanh) MLP, biases throughout, q|k|v fused head by head, a tied head; config.json in its own
    names (n_embed or hidden_size, n_layer, n_head, layer_norm_epsilon). No position table bounds
    the context: 2,048 tokens by default, as vLLM's, or --max-model-len."""
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
                                             "apply_residual_connection_post_layernorm": False,
                                             "max_position_embeddings": 2048}
    hf_tensor_map: ClassVar[TensorMap] = {**_bloom_map("transformer."), **_bloom_map(""),
                                          "lm_head.weight": ("lm_head.weight", None)}

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        hidden = raw.get("hidden_size") or raw["n_embed"]
        return {**raw, "hidden_size": hidden, "num_attention_heads": raw.get("num_attention_heads") or raw["n_head"],
                "num_hidden_layers": raw.get("num_hidden_layers") or raw["n_layer"], "intermediate_size": 4 * hidden,
                "rms_norm_eps": raw["layer_norm_epsilon"], "hidden_act": "gelu_new",
                "max_position_embeddings": raw.get("seq_length") or raw["max_position_embeddings"]}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw["apply_residual_connection_post_layernorm"]:
            raise ValueError("BloomForCausalLM with apply_residual_connection_post_layernorm is not supported")
        return {"qkv_bias": True, "o_bias": True, "sliding_window": None, "alibi_bias_max": 8.0,
                "rope_layers": (False,) * fields["num_layers"]}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        self.embed_norm = LayerNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def input_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        return self.embed_norm(super().input_hidden(input_ids, positions, inputs_embeds))

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(("self_attention.query_key_value.weight", "self_attention.query_key_value.bias")):
            return _qkv_by_part(tensor, self.config)
        return tensor


class MptForCausalLM(Starcoder2ForCausalLM):
    """MPT (mosaicml/mpt-7b and its chat and instruct models): ALiBi for positions (its
    ``attn_config.alibi_bias_max``), LayerNorms and projections without biases (``no_bias``), q|k|v
    fused in one tensor, a 4x exact-GELU MLP, a tied head; config.json in its own names (d_model,
    n_heads, n_layers, expansion_ratio, max_seq_len, attn_config). ``clip_qkv``, ``qk_ln``, learned
    positions without ALiBi and a ``logit_scale`` are refused by name."""
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_epsilon": 1e-5, "no_bias": True, "expansion_ratio": 4,
                                             "tie_word_embeddings": True, "attn_config": {}, "logit_scale": None}
    hf_tensor_map: ClassVar[TensorMap] = {
        "transformer.wte.weight": ("embed_tokens.weight", None),
        **{f"transformer.blocks.{{i}}.{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in (
            ("norm_1", "input_layernorm"), ("attn.Wqkv", "self_attn.qkv_proj"), ("attn.out_proj", "self_attn.o_proj"),
            ("norm_2", "post_attention_layernorm"), ("ffn.up_proj", "mlp.up_proj"), ("ffn.down_proj", "mlp.down_proj"))
           for p in ("weight", "bias")},
        **{f"transformer.norm_f.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
        "lm_head.weight": ("lm_head.weight", None),
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        hidden = raw["d_model"]
        return {**raw, "hidden_size": hidden, "num_attention_heads": raw["n_heads"], "num_hidden_layers": raw["n_layers"],
                "intermediate_size": int(raw["expansion_ratio"] * hidden), "max_position_embeddings": raw["max_seq_len"],
                "rms_norm_eps": raw["layer_norm_epsilon"], "hidden_act": "gelu"}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        attn = {"alibi": False, "alibi_bias_max": 8, "clip_qkv": None, "qk_ln": False, "softmax_scale": None,
                **(raw["attn_config"] or {})}
        odd = [what for what, bad in (("clip_qkv", attn["clip_qkv"]), ("qk_ln", attn["qk_ln"]),
                                      ("learned positions without alibi", not attn["alibi"]),
                                      ("logit_scale", raw["logit_scale"] is not None)) if bad]
        if odd:
            raise ValueError(f"MptForCausalLM with {', '.join(odd)} is not supported")
        bias = not raw["no_bias"]
        scale = attn["softmax_scale"]
        return {"qkv_bias": bias, "o_bias": bias, "norm_bias": bias, "sliding_window": None,
                "alibi_bias_max": float(attn["alibi_bias_max"]), "rope_layers": (False,) * fields["num_layers"],
                **({"query_pre_attn_scalar": float(scale) ** -2} if scale is not None else {})}


class MPTForCausalLM(MptForCausalLM):
    """MPT under the architecture name mosaicml's own checkpoints give (their config.json's)."""


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """GPT-BigCode (StarCoder 1, SantaCoder, WizardCoder, Granite 3B/8B Code's older saves): GPT-2's
    model with plain linear projections (no Conv1D transpose) and, with ``multi_query`` (the
    default), one key/value head shared by every query head: its fused projection's rows q | k | v;
    without it, per head (H, 3, D), reordered at load."""
    hf_defaults: ClassVar[dict[str, Any]] = {**GPT2LMHeadModel.hf_defaults, "activation_function": "gelu_pytorch_tanh",
                                             "multi_query": True}

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        out = super().hf_raw(raw)
        return {**out, "num_key_value_heads": 1 if raw["multi_query"] else out["num_attention_heads"]}

    def hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(_GPT2_BUFFERS):
                continue
            if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")) and self.config.num_kv_heads > 1:
                tensor = _qkv_by_part(tensor, self.config)
            yield name, tensor


class FalconForCausalLM(Starcoder2ForCausalLM):
    """Falcon (tiiuae/falcon-7b, 40b, 180b, Falcon2-11B): rotary over whole heads, LayerNorms, a 4x
    GELU MLP, biases only where ``bias``, a tied head. Falcon-7b: one key/value head
    (``multi_query``) and attention and the MLP in parallel on one norm; the new decoder
    architecture (40b, 180b): ``num_kv_heads`` groups whose q|k|v rows go group by group (each
    group's query heads, then its key, then its value: reordered at load) and a norm for each
    side (``num_ln_in_parallel_attn`` 2). Falcon-RW's ALiBi is refused by name (its biases scaled
    with the scores)."""
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_epsilon": 1e-5, "bias": False, "alibi": False,
                                             "multi_query": True, "parallel_attn": True,
                                             "new_decoder_architecture": False, "num_ln_in_parallel_attn": None,
                                             "num_kv_heads": None, "activation": "gelu", "ffn_hidden_size": None,
                                             "tie_word_embeddings": True, "max_position_embeddings": 2048}
    hf_tensor_map: ClassVar[TensorMap] = {
        "transformer.word_embeddings.weight": ("embed_tokens.weight", None),
        **{f"transformer.h.{{i}}.{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in (
            ("input_layernorm", "input_layernorm"), ("ln_attn", "input_layernorm"),
            ("post_attention_layernorm", "post_attention_layernorm"), ("ln_mlp", "post_attention_layernorm"),
            ("self_attention.query_key_value", "self_attn.qkv_proj"), ("self_attention.dense", "self_attn.o_proj"),
            ("mlp.dense_h_to_4h", "mlp.up_proj"), ("mlp.dense_4h_to_h", "mlp.down_proj")) for p in ("weight", "bias")},
        **{f"transformer.ln_f.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
        "lm_head.weight": ("lm_head.weight", None),
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        hidden, heads = raw["hidden_size"], raw.get("num_attention_heads") or raw["n_head"]
        if raw["new_decoder_architecture"]:
            kv = raw["num_kv_heads"] or heads
        else:
            kv = 1 if raw["multi_query"] else heads
        return {**raw, "num_attention_heads": heads, "num_hidden_layers": raw.get("num_hidden_layers") or raw["n_layer"],
                "num_key_value_heads": kv, "intermediate_size": raw["ffn_hidden_size"] or 4 * hidden,
                "rms_norm_eps": raw["layer_norm_epsilon"], "hidden_act": raw["activation"]}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw["alibi"]:
            raise ValueError("FalconForCausalLM with alibi (Falcon-RW: its biases scaled with the scores) is not "
                             "supported")
        new, parallel = bool(raw["new_decoder_architecture"]), bool(raw["parallel_attn"])
        norms = raw["num_ln_in_parallel_attn"] or (2 if new else 1)
        if new and not parallel and norms == 1:
            raise ValueError("FalconForCausalLM with the new decoder architecture, one norm and no parallel "
                             "attention is not supported")
        bias = bool(raw["bias"])
        return {"qkv_bias": bias, "o_bias": bias, "sliding_window": None,
                "parallel_residual": parallel or new, "shared_parallel_norm": not (new and norms == 2)}

    def layer_block(self, config: ArchConfig) -> str:
        if not config.parallel_residual:
            return SEQUENTIAL
        return PARALLEL if config.shared_parallel_norm else PARALLEL_TWO_NORMS

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not name.endswith(("self_attention.query_key_value.weight", "self_attention.query_key_value.bias")):
            return tensor
        c = self.config
        if c.num_kv_heads == 1:                       # q | k | v already
            return tensor
        # (KVH, G + 2, D) -> q (KVH * G, D) | k | v; with G = 1 (every head its own key) this is (H, 3, D)
        G, D = c.num_heads // c.num_kv_heads, c.head_size
        rows = tensor.reshape(c.num_kv_heads, G + 2, D, *tensor.shape[1:])
        return torch.cat([rows[:, :G].reshape(-1, *tensor.shape[1:]), rows[:, G].reshape(-1, *tensor.shape[1:]),
                          rows[:, G + 1].reshape(-1, *tensor.shape[1:])])


class _GPTJLayer(_Layer):
    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 block: str) -> None:
        super().__init__(config, layer, backend, dtype, block)     # no attention biases; the MLP's:
        self.mlp = MLP(config.hidden_size, config.intermediate_size,
                       hf_activation(config.hidden_act, config.architecture), dtype, bias=True)


class GPTJForCausalLM(Starcoder2ForCausalLM):
    """GPT-J (EleutherAI/gpt-j-6b, GPT4All-J): attention and the MLP in parallel on one LayerNorm, a
    rotary over the first ``rotary_dim`` dimensions of each head turning interleaved pairs (q's and
    k's rows put in the kernels' half-split order at load), no attention biases, a GELU MLP and an
    LM head with biases; config.json in GPT-2's names."""
    block: ClassVar[str] = PARALLEL
    lm_head_bias: ClassVar[bool] = True
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
                                             "n_inner": None, "rotary_dim": None, "tie_word_embeddings": False}
    hf_tensor_map: ClassVar[TensorMap] = {
        "transformer.wte.weight": ("embed_tokens.weight", None),
        **{f"transformer.h.{{i}}.attn.{s}_proj.weight": (f"layers.{{i}}.self_attn.qkv_proj.weight", s) for s in "qkv"},
        **{f"transformer.h.{{i}}.{theirs}.{p}": (f"layers.{{i}}.{ours}.{p}", None) for theirs, ours in (
            ("ln_1", "input_layernorm"), ("attn.out_proj", "self_attn.o_proj"), ("mlp.fc_in", "mlp.up_proj"),
            ("mlp.fc_out", "mlp.down_proj")) for p in ("weight", "bias")},
        **{f"transformer.ln_f.{p}": (f"norm.{p}", None) for p in ("weight", "bias")},
        **{f"lm_head.{p}": (f"lm_head.{p}", None) for p in ("weight", "bias")},
    }

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        hidden, heads = raw["n_embd"], raw["n_head"]
        out = {**raw, "hidden_size": hidden, "num_attention_heads": heads, "num_hidden_layers": raw["n_layer"],
               "intermediate_size": raw["n_inner"] or 4 * hidden, "max_position_embeddings": raw["n_positions"],
               "rms_norm_eps": raw["layer_norm_epsilon"], "hidden_act": raw["activation_function"]}
        if raw["rotary_dim"] is not None and raw.get("rope_parameters") is None:
            out["partial_rotary_factor"] = raw["rotary_dim"] / (hidden // heads)
        return out

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {"qkv_bias": False, "o_bias": False, "sliding_window": None}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        LocalGlobalLM.__init__(self)
        self.build(config, dtype, lambda i: _GPTJLayer(config, i, attn_backend, dtype, PARALLEL),
                   LayerNorm(config.hidden_size, config.rms_norm_eps, dtype), local=False, lm_head_bias=True)

    def hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(("attn.q_proj.weight", "attn.k_proj.weight")):
            c = self.config
            return interleaved_to_half_split(tensor, c.head_size, c.rotary_dim or c.head_size)
        return tensor
