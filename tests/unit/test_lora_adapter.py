"""LoRA adapters at the edge: a PEFT directory is validated against the architecture before
anything changes (missing files, bad config, unknown target modules, wrong shapes, ranks over the
limit, half a pair, unsupported PEFT options: each refused saying why); the scaling is lora_alpha
/ r, or / sqrt(r) with rsLoRA; --lora-modules takes name=path and vLLM's JSON object."""
from __future__ import annotations

import json
import math

import dataclasses
import pytest
import torch
from safetensors.torch import save_file

from actors.engine.args import EngineArgs
from actors.engine.lora import LoRAModulePath, parse_lora_module
from models.config import ArchConfig
from models.lora import InvalidAdapter, check_adapter, load_adapter

# hidden 32, 4 heads of 8 (q 32), 2 KV heads (k, v 16), intermediate 48, 2 layers
ARCH = ArchConfig("LlamaForCausalLM", 100, 32, 48, 2, 4, 2, 8, 256, 1e4, 1e-6, False, 1, (2,))
SHAPES = {"q_proj": (32, 32), "k_proj": (16, 32), "v_proj": (16, 32), "o_proj": (32, 32),
          "gate_proj": (48, 32), "up_proj": (48, 32), "down_proj": (32, 48)}


def write(path, r: int = 4, config: dict | None = None, tensors: dict | None = None, **cfg) -> str:
    path.mkdir(exist_ok=True)
    if tensors is None:
        tensors = {}
        for layer in range(2):
            for target in ("q_proj", "v_proj", "down_proj"):
                parent = "mlp" if target == "down_proj" else "self_attn"
                out, inp = SHAPES[target]
                name = f"base_model.model.model.layers.{layer}.{parent}.{target}"
                tensors[f"{name}.lora_A.weight"] = torch.ones(r, inp)
                tensors[f"{name}.lora_B.weight"] = torch.ones(out, r)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config if config is not None else {
        "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "v_proj", "down_proj"], "bias": "none", **cfg}))
    return str(path)


def test_a_good_adapter_passes_with_its_rank_scaling_and_modules(tmp_path):
    info = check_adapter(write(tmp_path / "ok", r=4), ARCH, 16)
    assert info.rank == 4 and info.scaling == 2.0 and len(info.modules) == 6
    assert check_adapter(write(tmp_path / "rs", r=4, use_rslora=True), ARCH, 16).scaling == 8 / math.sqrt(4)
    a, b = load_adapter(str(tmp_path / "ok"), ARCH, 16)["model.layers.1.mlp.down_proj"]
    assert a.shape == (4, 48) and b.shape == (32, 4) and float(b[0, 0]) == 2.0     # B scaled


def _tensor(target: str, layer: int = 0, parent: str = "self_attn", a=(4, 32), b=(32, 4)) -> dict:
    name = f"base_model.model.model.layers.{layer}.{parent}.{target}"
    return {f"{name}.lora_A.weight": torch.ones(*a), f"{name}.lora_B.weight": torch.ones(*b)}


@pytest.mark.parametrize("make, reason", [
    (lambda p: str(p / "nothing"), "no adapter directory"),
    (lambda p: (p.mkdir(), str(p))[1], "no adapter config"),
    (lambda p: write(p, r=32), "rank 32, more than --max-lora-rank 16"),
    (lambda p: write(p, tensors=_tensor("q_proj", a=(4, 31))), "do not fit the model"),
    (lambda p: write(p, tensors=_tensor("k_proj", b=(32, 4))), "do not fit the model"),
    (lambda p: write(p, tensors=_tensor("q_proj", layer=2)), "layer 2, the model has 2"),
    (lambda p: write(p, tensors=_tensor("lm_head")), "target module 'lm_head' is not supported"),
    (lambda p: write(p, tensors=_tensor("up_proj", parent="self_attn")), "up_proj is a module of mlp"),
    (lambda p: write(p, tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                                 torch.ones(4, 32)}), "not both lora_A and lora_B"),
    (lambda p: write(p, tensors={"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 100)}),
     "not a LoRA weight of a supported module"),
    (lambda p: write(p, config={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "embed_tokens"]}),
     "target modules ['embed_tokens'] are not supported"),
    (lambda p: write(p, use_dora=True), "DoRA adapters are not supported"),
    (lambda p: write(p, bias="all"), "bias 'all'"),
    (lambda p: write(p, config={"lora_alpha": 8}), "r must be a positive integer"),
])
def test_a_bad_adapter_is_refused_saying_why(tmp_path, make, reason):
    with pytest.raises(InvalidAdapter, match=reason.replace("[", r"\[").replace("]", r"\]")):
        check_adapter(make(tmp_path / "bad"), ARCH, 16)


def test_lora_modules_take_name_equals_path_and_vllms_json():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("x", "/p", "m")
    for bad in ("sql", "=p", '{"name": "x"}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    cfg = EngineArgs(enable_lora=True, max_loras=3, lora_modules=["a=/x", {"name": "b", "path": "/y"}]).lora_config()
    assert cfg.max_loras == 3 and cfg.cpu_capacity == 3 and [m.name for m in cfg.lora_modules] == ["a", "b"]
    with pytest.raises(ValueError, match="needs --enable-lora"):
        EngineArgs(lora_modules=["a=/x"]).lora_config()
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2).lora_config()


# BERT's layout: hidden 32, 4 heads of 8 (query, key, value 32 each), intermediate 48, 2 layers
BERT = dataclasses.replace(ARCH, architecture="BertModel", num_kv_heads=4, encoder_only=True)


def _bert_tensors(prefix: str = "", modules=("attention.self.query", "attention.output.dense", "output.dense"),
                  r: int = 4) -> dict:
    shapes = {"attention.self.query": (32, 32), "attention.output.dense": (32, 32), "intermediate.dense": (48, 32),
              "output.dense": (32, 48), "pooler.dense": (32, 32)}
    tensors = {}
    for module in modules:
        out, inp = shapes[module]
        names = [f"{prefix}pooler.dense"] if module == "pooler.dense" else [
            f"{prefix}encoder.layer.{layer}.{module}" for layer in range(2)]
        for name in names:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.ones(r, inp)
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.ones(out, r)
    return tensors


def test_a_bert_adapter_names_its_encoder_layers_and_leaves_the_bare_models_pooler_out(tmp_path):
    """An adapter PEFT wrote on BERT (targets query, dense, ...): its layers' modules, under the
    bare model's names or a classifier's ``bert.``; a bare model's ``pooler.dense`` (which its
    embeddings never pass through) is left out, as vLLM leaves it."""
    modules = ("attention.self.query", "attention.output.dense", "output.dense", "pooler.dense")
    info = check_adapter(write(tmp_path / "bare", tensors=_bert_tensors("", modules),
                               target_modules=["query", "dense"]), BERT, 16)
    assert info.modules == tuple(sorted(f"encoder.layer.{i}.{m}" for i in range(2) for m in modules[:3]))
    a, b = load_adapter(str(tmp_path / "bare"), BERT, 16)["encoder.layer.1.output.dense"]
    assert a.shape == (4, 48) and b.shape == (32, 4)
    classifier = dataclasses.replace(BERT, architecture="BertForSequenceClassification")
    assert len(check_adapter(write(tmp_path / "cls", tensors=_bert_tensors("bert."), target_modules=["query"]),
                             classifier, 16).modules) == 6


@pytest.mark.parametrize("arch, tensors, config, reason", [
    ("BertForSequenceClassification", _bert_tensors("bert.", ("pooler.dense",)), {}, "not a LoRA weight of a supported module"),
    ("BertModel", _bert_tensors("", ("intermediate.dense",)), {"target_modules": ["q_proj"]},
     "target modules ['q_proj'] are not supported"),
    ("BertModel", _bert_tensors("roberta."), {}, "not a LoRA weight of a supported module"),
    ("BertModel", _tensor("q_proj"), {}, "not a LoRA weight of a supported module"),
    ("ModernBertModel", _bert_tensors(), {"target_modules": ["Wo"]}, "not a LoRA weight of a supported module (a layer's attn.Wo"),
])
def test_an_encoder_adapter_for_other_modules_is_refused_saying_which(tmp_path, arch, tensors, config, reason):
    """A classifier's pooler (it runs, it is not adapted), the decoder's names on BERT, RoBERTa's
    prefix on BERT, BERT's names on ModernBERT, a target BERT has not."""
    path = write(tmp_path / "bad", tensors=tensors, **({"target_modules": ["dense"]} | config))
    with pytest.raises(InvalidAdapter, match=reason.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        check_adapter(path, dataclasses.replace(BERT, architecture=arch), 16)
