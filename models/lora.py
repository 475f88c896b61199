"""LoRA adapters in the PEFT format: a directory with ``adapter_config.json`` and
``adapter_model.safetensors``, whose tensors are named

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight

with A (r, in) and B (out, r); the layer computes W x + s B A x, s = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)).

``check_adapter`` validates an adapter against an architecture without torch (the frontend
calls it when an adapter is loaded: a bad one is refused before anything changes): it reads the
config and the safetensors header only. ``load_adapter`` reads the tensors (float32, B already
scaled by s) for the worker. Names are those of the Hugging Face checkpoint; the worker maps
them onto its fused layers through the model's ``hf_tensor_map``, so an adapter trained on the
Hugging Face model applies as well to the same model loaded from GGUF.

The encoders take their own modules' adapters, as vLLM does (its BERT embedding model, ModernBERT,
RoBERTa's classifier): BERT, RoBERTa and XLM-RoBERTa's
``[bert.|roberta.]encoder.layer.{i}.attention.self.{query,key,value}``, ``attention.output.dense``,
``intermediate.dense`` and ``output.dense`` (PEFT's targets ``query``, ``key``, ``value``,
``dense``); ModernBERT's ``[model.]layers.{i}.attn.{Wqkv,Wo}`` and ``mlp.{Wi,Wo}``. A bare encoder's
``pooler.dense``, which its embeddings never pass through (and which PEFT adapts for the target
``dense``), is left out, as vLLM leaves it.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

from models.config import ArchConfig

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FLOAT_DTYPES = ("F32", "F16", "BF16")
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class EncoderLayout(NamedTuple):
    """An encoder family's adaptable modules: ``module`` matches one's path (PEFT's, without
    ``base_model.model.``) as (layer, its name within the layer, a key of ``shapes``);
    ``skipped`` matches modules the model does not run (their tensors are left out); ``targets``
    are the names adapter_config.json's target_modules may give."""
    module: re.Pattern
    skipped: re.Pattern
    names: tuple[str, ...]                     # the adaptable modules' names within a layer
    targets: frozenset[str]
    shapes: Callable[[ArchConfig], dict[str, tuple[int, int]]]       # name within the layer -> (out, in)


def _bert_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    h, inner, i = arch.hidden_size, arch.num_heads * arch.head_size, arch.intermediate_size
    return {"attention.self.query": (inner, h), "attention.self.key": (inner, h), "attention.self.value": (inner, h),
            "attention.output.dense": (h, inner), "intermediate.dense": (i, h), "output.dense": (h, i)}


def _modernbert_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    h, i = arch.hidden_size, arch.intermediate_size
    return {"attn.Wqkv": (3 * h, h), "attn.Wo": (h, h), "mlp.Wi": (2 * i, h), "mlp.Wo": (h, i)}


def _layout(module: str, names: tuple[str, ...], skipped: str, shapes) -> EncoderLayout:
    """``module``: the layers' path pattern, its ``{}`` where a layer's module name goes."""
    # PEFT matches a target name against a module path's last parts: "dense", "output.dense", ...
    targets = frozenset(".".join(n.split(".")[-k:]) for n in names for k in range(1, n.count(".") + 2))
    alternatives = "|".join(re.escape(n) for n in names)
    return EncoderLayout(re.compile(module.format(f"({alternatives})")), re.compile(skipped), names, targets, shapes)


_BERT_NAMES = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
               "intermediate.dense", "output.dense")
_NOTHING = r"(?!)"
_ENCODER_LAYOUTS = {
    # a bare model's pooler (dense + tanh over the first token) does not make its embeddings; a
    # classifier's does, and is not adapted (its tensors are refused)
    ("bert", True): _layout(r"(?:bert\.)?encoder\.layer\.(\d+)\.{}", _BERT_NAMES, r"(?:bert\.)?pooler\.dense",
                            _bert_shapes),
    ("bert", False): _layout(r"(?:bert\.)?encoder\.layer\.(\d+)\.{}", _BERT_NAMES, _NOTHING, _bert_shapes),
    ("roberta", True): _layout(r"(?:roberta\.)?encoder\.layer\.(\d+)\.{}", _BERT_NAMES,
                               r"(?:roberta\.)?pooler\.dense", _bert_shapes),
    ("roberta", False): _layout(r"(?:roberta\.)?encoder\.layer\.(\d+)\.{}", _BERT_NAMES, _NOTHING, _bert_shapes),
    ("modernbert", False): _layout(r"(?:model\.)?layers\.(\d+)\.{}", ("attn.Wqkv", "attn.Wo", "mlp.Wi", "mlp.Wo"),
                                   _NOTHING, _modernbert_shapes),
}


def encoder_layout(arch: ArchConfig) -> EncoderLayout | None:
    """The encoder family of ``arch``'s adapters, or None (a decoder's layers: the names above)."""
    name = arch.architecture
    if not arch.encoder_only:
        return None
    if name.startswith("ModernBert"):
        return _ENCODER_LAYOUTS["modernbert", False]
    bare = name.endswith("Model")
    if name.startswith(("Roberta", "XLMRoberta")):
        return _ENCODER_LAYOUTS["roberta", bare]
    if name.startswith("Bert"):
        return _ENCODER_LAYOUTS["bert", bare]
    return None


class InvalidAdapter(ValueError):
    """The adapter cannot be served on this model; the message says why."""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    rank: int                                  # the largest rank among its modules
    scaling: float                             # lora_alpha / r (rsLoRA: / sqrt(r))
    modules: tuple[str, ...]                   # "model.layers.{i}.{self_attn|mlp}.{target}", sorted


def module_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module of ``arch``."""
    q, kv, h, i = arch.num_heads * arch.head_size, arch.num_kv_heads * arch.head_size, arch.hidden_size, \
        arch.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def read_safetensors_header(path: str) -> dict[str, dict]:
    """The header of a safetensors file: name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise InvalidAdapter(f"{path} is not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise InvalidAdapter(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise InvalidAdapter(f"{path} is not a safetensors file (its header is not JSON)") from None
    header.pop("__metadata__", None)
    return header


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            cfg = json.load(f)
    except OSError as exc:
        raise InvalidAdapter(f"no adapter config at {file}: {exc.strerror}") from None
    except ValueError as exc:
        raise InvalidAdapter(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise InvalidAdapter(f"{file} is not a JSON object")
    return cfg


def _scaling(cfg: dict) -> tuple[int, float]:
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1:
        raise InvalidAdapter(f"adapter_config.json: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)):
        raise InvalidAdapter(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    for key, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if cfg.get(key):
            raise InvalidAdapter(f"{what} adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise InvalidAdapter(f"adapters with bias {cfg['bias']!r} are not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise InvalidAdapter(f"adapters with modules_to_save ({cfg['modules_to_save']}) are not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise InvalidAdapter("adapters with rank_pattern or alpha_pattern are not supported")
    return r, alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


def _check_targets(cfg: dict, supported: frozenset[str] | tuple[str, ...]) -> None:
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(supported))
        if unknown:
            raise InvalidAdapter(f"target modules {unknown} are not supported; supported: {sorted(supported)}")


_LORA_TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


def _decoder_module(name: str, shapes: dict[str, tuple[int, int]]) -> tuple[str, int, str]:
    """(module, layer, shape key) of a decoder adapter's tensor ``name``."""
    m = _TENSOR.fullmatch(name)
    if m is None:
        raise InvalidAdapter(f"tensor {name!r} is not a LoRA weight of a supported module "
                             f"({', '.join(TARGET_MODULES)})")
    layer, parent, target = int(m[1]), m[2], m[3]
    if target not in shapes:
        raise InvalidAdapter(f"tensor {name!r}: target module {target!r} is not supported; "
                             f"supported: {list(TARGET_MODULES)}")
    if _PARENT[target] != parent:
        raise InvalidAdapter(f"tensor {name!r}: {target} is a module of {_PARENT[target]}, not of {parent}")
    return name.rsplit(".lora_", 1)[0].removeprefix("base_model.model."), layer, target


def _encoder_module(name: str, layout: EncoderLayout) -> tuple[str, int, str] | None:
    """(module, layer, shape key) of an encoder adapter's tensor ``name``; None: a module the
    model does not run."""
    m = _LORA_TENSOR.fullmatch(name)
    module = m[1] if m else None
    if module is not None and layout.skipped.fullmatch(module):
        return None
    found = layout.module.fullmatch(module) if module is not None else None
    if found is None:
        raise InvalidAdapter(f"tensor {name!r} is not a LoRA weight of a supported module "
                             f"(a layer's {', '.join(sorted(layout.names))})")
    return module, int(found[1]), found[2]


def check_adapter(path: str, arch: ArchConfig, max_lora_rank: int) -> AdapterInfo:
    """Validate the adapter at ``path`` for ``arch`` (files, config, every tensor's name, dtype
    and shape, ranks up to ``max_lora_rank``) without reading its weights; raises
    InvalidAdapter saying what is wrong."""
    if not os.path.isdir(path):
        raise InvalidAdapter(f"no adapter directory at {path}")
    cfg = _read_config(path)
    r, scaling = _scaling(cfg)
    layout = encoder_layout(arch)
    _check_targets(cfg, TARGET_MODULES if layout is None else layout.targets)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise InvalidAdapter(f"no {WEIGHTS_FILE} in {path}")
    shapes = module_shapes(arch) if layout is None else layout.shapes(arch)
    found: dict[str, dict[str, list[int]]] = {}
    shape_of: dict[str, str] = {}
    for name, meta in read_safetensors_header(file).items():
        where = _decoder_module(name, shapes) if layout is None else _encoder_module(name, layout)
        if where is None:
            continue
        module, layer, key = where
        if layer >= arch.num_layers:
            raise InvalidAdapter(f"tensor {name!r}: layer {layer}, the model has {arch.num_layers}")
        if meta.get("dtype") not in FLOAT_DTYPES:
            raise InvalidAdapter(f"tensor {name!r} has dtype {meta.get('dtype')}; accepted: {list(FLOAT_DTYPES)}")
        found.setdefault(module, {})[name.rsplit(".lora_", 1)[1][0]] = list(meta.get("shape", ()))
        shape_of[module] = key
    if not found:
        raise InvalidAdapter(f"{file} holds no LoRA weights")
    rank = 0
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise InvalidAdapter(f"module {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        out, inp = shapes[shape_of[module]]
        mr = ab["A"][0] if len(ab["A"]) == 2 else -1
        if ab["A"] != [mr, inp] or ab["B"] != [out, mr] or mr < 1:
            raise InvalidAdapter(f"module {module}: lora_A {ab['A']} and lora_B {ab['B']} do not fit the model "
                                 f"(expected [r, {inp}] and [{out}, r])")
        if mr > max_lora_rank:
            raise InvalidAdapter(f"module {module} has rank {mr}, more than --max-lora-rank {max_lora_rank}")
        rank = max(rank, mr)
    return AdapterInfo(rank, scaling, tuple(sorted(found)))


def load_adapter(path: str, arch: ArchConfig, max_lora_rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's weights after ``check_adapter``: module name ("model.layers.{i}.mlp.up_proj")
    -> (A (r, in), s B (out, r)), float32 on the CPU."""
    import torch
    from safetensors.torch import load_file
    info = check_adapter(path, arch, max_lora_rank)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE), device="cpu")
    out = {}
    for module in info.modules:
        a = tensors[f"base_model.model.{module}.lora_A.weight"].to(torch.float32).contiguous()
        b = tensors[f"base_model.model.{module}.lora_B.weight"].to(torch.float32) * info.scaling
        out[module] = (a, b.contiguous())
    return out
