"""BERT with rotary positions (vLLM's bert_with_rope models): tiny random nomic-bert (SwiGLU and
GELU MLPs, a partial rotary), GTE v1.5 (GeGLU from its one value|gate tensor, NTK-scaled rope, as
GteNewModel and under Snowflake's GteModel name) and GTE's reranker, saved with their own tensor
names and config keys, embed and classify as a plain torch rendering of their layers computes
(each model's modelling code is remote code, not in transformers; checkpoints of these layouts
with heads of 32, the least vLLM's CPU attention takes, gave vLLM 0.32's embeddings within 4e-7
when checked by hand), in one engine and over two
tensor-parallel ranks; GTE's "NewModel" name is refused pointing at vLLM's override."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from actors.api import LLM

pytestmark = pytest.mark.slow

VOCAB, HIDDEN, HEADS, INTER, LAYERS = 128, 64, 4, 96, 2
PROMPTS = [[1, 5, 9, 2, 7, 3, 2], [1, *((7 * i + 5) % 120 + 4 for i in range(40)), 2], [1, 12, 2]]


def _nomic(act: str, fraction: float) -> tuple[dict, dict]:
    """(config.json, tensors) of a tiny nomic-bert in its own names."""
    config = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "n_embd": HIDDEN, "n_head": HEADS,
              "n_inner": INTER, "n_layer": LAYERS, "n_positions": 128, "vocab_size": VOCAB, "type_vocab_size": 2,
              "activation_function": act, "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
              "rotary_emb_base": 1000, "rotary_emb_fraction": fraction, "rotary_emb_interleaved": False,
              "rotary_emb_scale_base": None, "layer_norm_epsilon": 1e-12, "max_trained_positions": 128,
              "prenorm": False, "causal": False, "pad_token_id": 0}
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.2            # noqa: E731
    ln = lambda: (1 + r(HIDDEN), r(HIDDEN))                             # noqa: E731
    t = {"embeddings.word_embeddings.weight": r(VOCAB, HIDDEN), "embeddings.token_type_embeddings.weight": r(2, HIDDEN)}
    t["emb_ln.weight"], t["emb_ln.bias"] = ln()
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        t[p + "attn.Wqkv.weight"], t[p + "attn.out_proj.weight"] = r(3 * HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        if act == "swiglu":
            t[p + "mlp.fc11.weight"], t[p + "mlp.fc12.weight"] = r(INTER, HIDDEN), r(INTER, HIDDEN)
        else:
            t[p + "mlp.fc1.weight"] = r(INTER, HIDDEN)
        t[p + "mlp.fc2.weight"] = r(HIDDEN, INTER)
        (t[p + "norm1.weight"], t[p + "norm1.bias"]), (t[p + "norm2.weight"], t[p + "norm2.bias"]) = ln(), ln()
    return config, t


def _gte(architecture: str, labels: int = 0) -> tuple[dict, dict]:
    """(config.json, tensors) of a tiny GTE v1.5 ("new" implementation) in its own names."""
    config = {"architectures": [architecture], "model_type": "new", "hidden_size": HIDDEN, "num_attention_heads": HEADS,
              "intermediate_size": INTER, "num_hidden_layers": LAYERS, "max_position_embeddings": 64,
              "vocab_size": VOCAB, "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
              "layer_norm_type": "layer_norm", "position_embedding_type": "rope", "rope_theta": 500000.0,
              "rope_scaling": {"type": "ntk", "factor": 2.0}, "pad_token_id": 0, "logn_attention_scale": False}
    prefix = "new." if labels else ""
    if labels:
        config["id2label"] = {str(i): f"L{i}" for i in range(labels)}
    g = torch.Generator().manual_seed(1)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.2            # noqa: E731
    e = prefix + "embeddings."
    t = {e + "word_embeddings.weight": r(VOCAB, HIDDEN), e + "token_type_embeddings.weight": r(2, HIDDEN),
         e + "LayerNorm.weight": 1 + r(HIDDEN), e + "LayerNorm.bias": r(HIDDEN)}
    for i in range(LAYERS):
        p = f"{prefix}encoder.layer.{i}."
        t[p + "attention.qkv_proj.weight"], t[p + "attention.qkv_proj.bias"] = r(3 * HIDDEN, HIDDEN), r(3 * HIDDEN)
        t[p + "attention.o_proj.weight"], t[p + "attention.o_proj.bias"] = r(HIDDEN, HIDDEN), r(HIDDEN)
        t[p + "mlp.up_gate_proj.weight"] = r(2 * INTER, HIDDEN)
        t[p + "mlp.down_proj.weight"], t[p + "mlp.down_proj.bias"] = r(HIDDEN, INTER), r(HIDDEN)
        for norm in ("attn_ln", "mlp_ln"):
            t[p + norm + ".weight"], t[p + norm + ".bias"] = 1 + r(HIDDEN), r(HIDDEN)
    if labels:
        t["new.pooler.dense.weight"], t["new.pooler.dense.bias"] = r(HIDDEN, HIDDEN), r(HIDDEN)
        t["classifier.weight"], t["classifier.bias"] = r(labels, HIDDEN), r(labels)
    return config, t


def _save(path, config: dict, tensors: dict) -> str:
    from helpers import save_tiny_tokenizer
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    save_tiny_tokenizer(path, VOCAB)
    return str(path)


def _rotary(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotary of the leading ``rotary_dim`` dimensions of x (n, H, D)."""
    angles = positions[:, None].float() * inv_freq[None]                    # (n, rotary_dim / 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    turned, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    a, b = turned.chunk(2, -1)
    return torch.cat([turned * cos + torch.cat([-b, a], -1) * sin, rest], -1)


def _reference(kind: str, config: dict, t: dict, ids: list[int]) -> torch.Tensor:
    """The last hidden states (n, hidden) of one prompt, from the checkpoint's tensors by name."""
    n, D = len(ids), HIDDEN // HEADS
    ln = lambda x, name: F.layer_norm(x, (HIDDEN,), t[name + ".weight"], t[name + ".bias"], 1e-12)   # noqa: E731
    positions = torch.arange(n)
    if kind == "nomic":
        rotary_dim = int(D * config["rotary_emb_fraction"])
        inv_freq = 1.0 / (1000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        x = ln(t["embeddings.word_embeddings.weight"][ids] + t["embeddings.token_type_embeddings.weight"][0], "emb_ln")
        names = lambda i: dict(qkv=f"encoder.layers.{i}.attn.Wqkv", o=f"encoder.layers.{i}.attn.out_proj",   # noqa: E731
                               ln1=f"encoder.layers.{i}.norm1", ln2=f"encoder.layers.{i}.norm2",
                               down=f"encoder.layers.{i}.mlp.fc2")
    else:
        rotary_dim, factor = D, 2.0                                  # fixed NTK: base x factor, freqs / factor^(2/d)
        inv_freq = 1.0 / ((500000.0 * factor) ** (torch.arange(0, D, 2).float() / D)) / factor ** (2 / D)
        e = "new.embeddings." if "new.embeddings.LayerNorm.weight" in t else "embeddings."
        x = ln(t[e + "word_embeddings.weight"][ids] + t[e + "token_type_embeddings.weight"][0], e + "LayerNorm")
        p = e.removesuffix("embeddings.") + "encoder.layer."
        names = lambda i: dict(qkv=f"{p}{i}.attention.qkv_proj", o=f"{p}{i}.attention.o_proj",   # noqa: E731
                               ln1=f"{p}{i}.attn_ln", ln2=f"{p}{i}.mlp_ln", down=f"{p}{i}.mlp.down_proj")
    linear = lambda x, name: F.linear(x, t[name + ".weight"], t.get(name + ".bias"))        # noqa: E731
    for i in range(LAYERS):
        m = names(i)
        q, k, v = linear(x, m["qkv"]).view(n, 3, HEADS, D).unbind(1)
        q, k = _rotary(q, positions, rotary_dim, inv_freq), _rotary(k, positions, rotary_dim, inv_freq)
        attn = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5, -1)
        x = ln(x + linear(torch.einsum("hqk,khd->qhd", attn, v).reshape(n, HIDDEN), m["o"]), m["ln1"])
        if kind == "nomic" and config["activation_function"] == "swiglu":
            h = linear(x, f"encoder.layers.{i}.mlp.fc11") * F.silu(linear(x, f"encoder.layers.{i}.mlp.fc12"))
        elif kind == "nomic":
            h = F.gelu(linear(x, f"encoder.layers.{i}.mlp.fc1"))
        else:
            value, gate = F.linear(x, t[m["qkv"].replace("attention.qkv_proj", "mlp.up_gate_proj") + ".weight"]).chunk(2, -1)
            h = value * F.gelu(gate)
        x = ln(x + linear(h, m["down"]), m["ln2"])
    return x


@pytest.mark.parametrize("variant", ["nomic-swiglu", "nomic-gelu-partial-rotary", "gte", "snowflake-gte"])
def test_a_bert_with_rope_embedder_embeds_as_its_layers_compute(tmp_path, variant):
    """Each prompt's CLS embedding (vLLM's default pooling for these), normalized, as the torch
    rendering of the checkpoint computes it, prompts of 3 to 42 tokens batched; split over two
    tensor-parallel ranks too (nomic SwiGLU and GTE)."""
    kind = "nomic" if variant.startswith("nomic") else "gte"
    if kind == "nomic":
        config, tensors = _nomic("swiglu" if "swiglu" in variant else "gelu", 0.5 if "partial" in variant else 1.0)
    else:
        config, tensors = _gte("GteModel" if variant.startswith("snowflake") else "GteNewModel")
    path = _save(tmp_path / variant, config, tensors)
    with torch.no_grad():
        expected = [F.normalize(_reference(kind, config, tensors, p)[0], dim=-1).numpy() for p in PROMPTS]
    for tp in ((1, 2) if variant in ("nomic-swiglu", "gte") else (1,)):
        with LLM(path, multiprocess=tp > 1, tensor_parallel_size=tp) as llm:
            outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        for out, want in zip(outs, expected):
            np.testing.assert_allclose(out.outputs.embedding, want, atol=2e-6)


def test_gtes_reranker_classifies_through_its_pooler_and_classifier(tmp_path):
    """GteNewForSequenceClassification: BERT's pooler (dense + tanh) over the CLS token's hidden
    state, then the classifier; LLM.classify's probabilities are the softmax of those logits."""
    config, tensors = _gte("GteNewForSequenceClassification", labels=3)
    path = _save(tmp_path / "reranker", config, tensors)
    with LLM(path, multiprocess=False) as llm:
        outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, p in zip(outs, PROMPTS):
        with torch.no_grad():
            cls = _reference("gte", config, tensors, p)[0]
            logits = F.linear(torch.tanh(F.linear(cls, tensors["new.pooler.dense.weight"], tensors["new.pooler.dense.bias"])),
                              tensors["classifier.weight"], tensors["classifier.bias"])
        np.testing.assert_allclose(out.outputs.probs, torch.softmax(logits, -1).numpy(), atol=2e-6)


def test_gtes_own_architecture_name_is_refused_naming_vllms_override(tmp_path):
    """config.json's "NewModel" (GTE v1.5's remote code) is served as vLLM serves it, under the
    override to GteNewModel: without it the start says which override to give; with it, served."""
    config, tensors = _gte("NewModel")
    path = _save(tmp_path / "new", config, tensors)
    from actors.runtime.errors import RemoteError
    with pytest.raises(RemoteError, match=r"--hf-overrides '\{\"architectures\": \[\"GteNewModel\"\]\}'"):
        LLM(path, multiprocess=False)
    with LLM(path, multiprocess=False, hf_overrides={"architectures": ["GteNewModel"]}) as llm:
        (out,) = llm.embed([{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False)
    with torch.no_grad():
        expected = F.normalize(_reference("gte", config, tensors, PROMPTS[0])[0], dim=-1).numpy()
    np.testing.assert_allclose(out.outputs.embedding, expected, atol=2e-6)


def test_a_nomic_bert_with_layers_of_another_kind_is_refused_naming_them():
    """nomic-bert's mixture-of-experts form (nomic-embed-text-v2-moe), its prenorm or RMS-norm
    variants and an interleaved rotary are not these layers: the config is refused naming them."""
    from models.hf_config import hf_model_config
    config, _ = _nomic("swiglu", 1.0)
    for changes, words in (({"moe_every_n_layers": 2, "num_experts": 8}, "a mixture-of-experts MLP"),
                           ({"prenorm": True, "use_rms_norm": True}, "prenorm layers, RMS norms"),
                           ({"rotary_emb_interleaved": True}, "an interleaved rotary"),
                           ({"activation_function": "relu"}, "activation_function 'relu'")):
        with pytest.raises(ValueError, match=f"NomicBertModel with {words}"):
            hf_model_config({**config, **changes})
    assert hf_model_config(config).hidden_act == "silu"
