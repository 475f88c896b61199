"""Loading models: the built-in architectures' classes (the registry itself, plugins' entries
included, is models/architectures.py; each class declares the rest, models/base.py), and ``load_model``, which
picks an attention backend, builds a model and dispatches checkpoint tensors onto it through
the model's tensor map."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionRequirements
from kernels.attention.selector import select_backend
from models.architectures import BUILTIN_ARCHITECTURES, ModelRegistry
from models.base import CausalLM
from models.config import ArchConfig
from models.gguf_header import GGUFFile
from models.gguf_loader import gguf_model_config, iter_gguf_weights, read_gguf, with_gguf_overrides
from models.hf_config import read_hf_config, read_quantization_config
from models.layers import MergedLinear
from models.quantization import attach_linear_methods, process_weights_after_loading, quantized_layers, \
    resolve_quantization
from models.resolve import ModelSource
from models.safetensors_loader import iter_safetensors_weights

MODEL_REGISTRY: dict[str, type[CausalLM]] = {   # the built-in classes, imported
    name: ModelRegistry.get_model_class(name) for name in BUILTIN_ARCHITECTURES}
DEFAULT_BLOCK_SIZE = 16   # what backend selection assumes when the caller does not say


def _gguf_architectures(registry: dict[str, type[CausalLM]]) -> dict[str, str]:
    """general.architecture -> Hugging Face architecture name, from the classes' declarations."""
    names: dict[str, str] = {}
    for architecture, model_class in registry.items():
        for gguf_name in model_class.gguf_architectures:
            if gguf_name in names:
                raise ValueError(f"GGUF architecture {gguf_name!r} is declared by both {names[gguf_name]} "
                                 f"and {architecture}")
            names[gguf_name] = architecture
    return names


GGUF_ARCHITECTURES = _gguf_architectures(MODEL_REGISTRY)   # the built-in classes'


def get_model_class(architecture: str) -> type[CausalLM]:
    return ModelRegistry.get_model_class(architecture)


def hf_architecture_of_gguf(gguf_architecture: str | None) -> str:
    """The Hugging Face architecture name of a GGUF ``general.architecture`` (any registered
    class may declare GGUF names, plugins' included: those registered by name are imported only
    when no built-in class claims the GGUF name, and one that cannot be imported is passed over,
    named in the error if nothing else claims it)."""
    if gguf_architecture in GGUF_ARCHITECTURES:
        return GGUF_ARCHITECTURES[gguf_architecture]
    classes, unimportable = {}, []
    for arch in ModelRegistry.get_supported_archs():
        try:
            classes[arch] = get_model_class(arch)
        except ValueError as exc:
            unimportable.append(str(exc))
    names = _gguf_architectures(classes)
    if gguf_architecture not in names:
        raise ValueError(f"GGUF architecture {gguf_architecture!r} is not supported; supported: {sorted(names)}"
                         + "".join(f"; {why}" for why in unimportable))
    return names[gguf_architecture]


class LoadedModel(NamedTuple):
    model: nn.Module
    config: ArchConfig


class Checkpoint(NamedTuple):
    """A checkpoint opened for loading: its architecture, read from its header, and its weights,
    read only as a model is built."""
    config: ArchConfig
    weights: Iterator[tuple[str, torch.Tensor]]     # lazy (checkpoint name, float32 tensor)
    tensor_map: str                                 # the model class's map for these names
    quantization_config: dict | None = None         # config.json's quantization_config
    path: str | None = None                         # the .gguf file or checkpoint directory
    overrides: dict | None = None                   # its --hf-overrides (config.json keys)


def attention_requirements(config: ArchConfig, dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE,
                           device: str = "cpu", kv_cache_dtype: torch.dtype | None = None) -> AttentionRequirements:
    return AttentionRequirements(dtype=dtype, kv_cache_dtype=kv_cache_dtype or dtype, head_size=config.head_size,
                                 block_size=block_size, sliding_window=config.max_sliding_window, device=device,
                                 logits_soft_cap=config.attn_logit_softcapping is not None,
                                 sinks=config.attention_sinks,
                                 alibi=config.alibi_bias_max is not None)


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32,
               attn_backend: AttentionBackend | None = None,
               block_size: int = DEFAULT_BLOCK_SIZE, device: str = "cpu",
               kv_cache_dtype: torch.dtype | None = None, quantization: str | None = None,
               max_model_len: int = 0) -> LoadedModel:
    """Build the model for ``source`` with its weights, in eval mode, on ``device`` ("cpu" or
    "cuda"), quantized as its checkpoint says or as ``quantization`` (--quantization) asks,
    its rotary tables for contexts of ``max_model_len`` (0: the model's default; what longrope
    and dynamic rope scaling choose by). Attention goes through ``attn_backend``, by default the first backend that accepts
    the model's requirements on that device and KV cache dtype (``kv_cache_dtype``, by default
    ``dtype``; raises ValueError naming every backend's refusal when none does). Weights are always read and converted on the CPU, then moved: the host
    briefly holds the model in ``dtype`` (plus one float32 tensor at a time while loading)."""
    ckpt = open_checkpoint(source)
    ckpt = ckpt._replace(config=ckpt.config.serving(max_model_len))
    return LoadedModel(build_model(ckpt, dtype, attn_backend, block_size, device, kv_cache_dtype, quantization),
                       ckpt.config)


def build_model(ckpt: Checkpoint, dtype: torch.dtype = torch.float32, attn_backend: AttentionBackend | None = None,
                block_size: int = DEFAULT_BLOCK_SIZE, device: str = "cpu",
                kv_cache_dtype: torch.dtype | None = None, quantization: str | None = None,
                transform: Callable[[nn.Module], Any] | None = None) -> nn.Module:
    """``load_model`` for a checkpoint already opened (its weights are consumed). ``transform``:
    applied once the weights are loaded, before quantized layers process theirs (a pipeline
    stage's cut, a tensor-parallel rank's split)."""
    config = ckpt.config
    backend = attn_backend or select_backend(attention_requirements(config, dtype, block_size, device,
                                                                    kv_cache_dtype))
    model = get_model_class(config.architecture)(config, backend, dtype)
    if hasattr(model, "load_checkpoint"):       # it reads its checkpoint itself (the transformers backend)
        return _self_loading(model, ckpt, quantization, device, transform)
    tensor_map = getattr(model, ckpt.tensor_map)
    if config.num_labels and not config.score_from_tokens:   # a classifier's score head, in float32 (vLLM's)
        own_head = model.classifier_head(config) if hasattr(model, "classifier_head") else None
        if ckpt.tensor_map != "hf_tensor_map":
            raise ValueError("a classifier (--convert classify) needs its score head, which only a Hugging Face "
                             "checkpoint (score.weight) holds")
        if config.score_mlp:       # a reward model's: hidden -> hidden, ReLU, -> labels (biases)
            model.score = nn.Sequential(nn.Linear(config.hidden_size, config.hidden_size, dtype=torch.float32),
                                        nn.ReLU(), nn.Linear(config.hidden_size, config.num_labels, dtype=torch.float32))
            tensor_map = {**tensor_map, **{f"score.{i}.{p}": (f"score.{i}.{p}", None) for i in (0, 2)
                                           for p in ("weight", "bias")}}
        elif own_head is not None:       # the model's own (an encoder's pooler and classifier)
            model.score = own_head
        else:
            model.score = nn.Linear(config.hidden_size, config.num_labels, bias=config.score_bias,
                                    dtype=torch.float32)
            tensor_map = {**tensor_map, "score.weight": ("score.weight", None), "score.bias": ("score.bias", None)}
    weights, skipped = ckpt.weights, model.hf_skipped_prefixes
    if skipped and ckpt.tensor_map == "hf_tensor_map":    # a trainer's round may hold the vision side too
        weights = ((name, tensor) for name, tensor in weights if not name.startswith(skipped))
    if ckpt.tensor_map == "hf_tensor_map":
        weights = model.hf_weights(weights)
    quant = resolve_quantization(quantization, ckpt.quantization_config, ckpt.path, device, dtype)
    if quant is not None:
        attach_linear_methods(model, quant, tensor_map)
    try:
        load_weights(model, weights, tensor_map)
    except ValueError as exc:
        if config.num_labels and "'score." in str(exc) and "unloaded" in str(exc):
            raise ValueError("the checkpoint has no score head (score.weight): --convert classify serves a "
                             "classifier's checkpoint (...ForSequenceClassification)") from None
        raise
    if config.score_from_tokens:       # before any split: the LM head whole
        model.score = score_from_lm_head(model.lm_head.weight, config.score_from_tokens, config.num_labels)
    if config.image_token_id is not None:      # its vision tower, read beside the language model
        model.load_vision(ckpt.path, ckpt.overrides)
    if config.audio_token_id is not None:      # its audio tower
        model.load_audio(ckpt.path, ckpt.overrides)
    if transform is not None:
        transform(model)
    if quant is not None:
        process_weights_after_loading(model)
    if device != "cpu":
        model = model.to(device)
    return model.eval()


def _self_loading(model: nn.Module, ckpt: Checkpoint, quantization: str | None, device: str,
                  transform: Callable[[nn.Module], Any] | None) -> nn.Module:
    """``build_model`` for a model that reads its own checkpoint directory."""
    name = type(model).__name__
    if ckpt.tensor_map != "hf_tensor_map" or ckpt.path is None:
        raise ValueError(f"{name} reads Hugging Face checkpoint directories, not GGUF files")
    if quantization is not None or ckpt.quantization_config is not None:
        method = quantization or ckpt.quantization_config.get("quant_method")
        raise ValueError(f"{name}: quantized checkpoints ({method}) are not supported")
    if ckpt.config.score_from_tokens or ckpt.config.score_mlp:
        raise ValueError(f"{name}: a score head made from the LM head's rows or a reward model's MLP needs one of "
                         "Troupe's own architectures")
    model.load_checkpoint(ckpt.path, ckpt.overrides)
    if transform is not None:
        transform(model)
    if device != "cpu":
        model = model.to(device)
    return model.eval()


def score_from_lm_head(lm_head: torch.Tensor, token_ids: tuple[int, ...], num_labels: int) -> nn.Linear:
    """vLLM's classifier_from_token: a score head (float32) from the LM head's rows of
    ``token_ids``; one label from two tokens is row[true] - row[false] (from_2_way_softmax: its
    sigmoid is the softmax of the two tokens' logits), otherwise each row is a label's."""
    rows = lm_head.detach().float()[list(token_ids)]
    weight = rows[1:2] - rows[0:1] if num_labels == 1 and len(token_ids) == 2 else rows
    score = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.float32)
    with torch.no_grad():
        score.weight.copy_(weight)
    return score


def model_config(source: ModelSource) -> ArchConfig:
    """The architecture config of a source, without reading its weights."""
    if source.kind == "gguf":
        return _gguf_config(read_gguf(source.path), source)
    if source.kind == "hf_dir":
        return read_hf_config(source.path, hf_overrides(source), source.model_impl, source.language_model_only)
    return open_checkpoint(source).config       # says which kinds there are


def hf_overrides(source: ModelSource) -> dict[str, Any]:
    """The source's --hf-overrides (config.json keys over the checkpoint's)."""
    return json.loads(source.hf_overrides) if source.hf_overrides else {}


def _gguf_config(gguf: GGUFFile, source: ModelSource) -> ArchConfig:
    config = gguf_model_config(gguf)
    overrides = hf_overrides(source)
    return with_gguf_overrides(config, overrides) if overrides else config


def open_checkpoint(source: ModelSource) -> Checkpoint:
    """The checkpoint of a source: its header read, its weights not yet."""
    if source.kind == "gguf":
        gguf = read_gguf(source.path)
        config = _gguf_config(gguf, source)
        return Checkpoint(config, iter_gguf_weights(gguf, config), "gguf_tensor_map", path=source.path)
    if source.kind == "hf_dir":
        config = read_hf_config(source.path, hf_overrides(source), source.model_impl, source.language_model_only)
        skipped = get_model_class(config.architecture).hf_skipped_prefixes
        return Checkpoint(config, iter_safetensors_weights(source.path, skipped),
                          "hf_tensor_map", read_quantization_config(source.path), source.path, hf_overrides(source))
    raise ValueError(f"model source kind {source.kind!r} is not supported; supported: 'gguf', 'hf_dir'")


# a bare decoder stack's top-level modules: saved without its causal LM's "model." prefix
_BARE_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def pooling_checkpoint(ckpt: Checkpoint, num_labels: int = 0, score_bias: bool = False,
                       score_from_tokens: tuple[int, ...] = (), score_mlp: bool = False) -> Checkpoint:
    """``ckpt`` served as a pooling model (--runner pooling): its LM head never runs, so it
    is tied to the embeddings (a checkpoint's own head, when it has one, is skipped, and a bare
    decoder stack's, which has none, is not missed), and a bare stack's tensor names (without
    the "model." prefix, as transformers saves a ``LlamaModel``) read as its causal LM's. A
    classifier's (``num_labels``): its ``score`` head (hidden -> labels, with a bias where
    ``score_bias``: a token classifier's) is loaded too, or made from the LM head's rows of
    ``score_from_tokens`` (vLLM's classifier_from_token: the LM head is then loaded); a reward
    model's is an MLP (``score_mlp``)."""
    weights = ckpt.weights
    if ckpt.tensor_map == "hf_tensor_map":
        weights = (("model." + name if name.startswith(_BARE_PREFIXES) else name, tensor) for name, tensor in weights)
    tied = ckpt.config.tie_word_embeddings or not score_from_tokens     # a head made from LM rows keeps them
    return ckpt._replace(config=dataclasses.replace(ckpt.config, tie_word_embeddings=tied, num_labels=num_labels,
                                                    score_bias=score_bias, score_from_tokens=score_from_tokens,
                                                    score_mlp=score_mlp),
                         weights=weights)


def _compile_tensor_map(tensor_map: dict[str, tuple[str, str | None]]) -> list[tuple[re.Pattern, str, str | None]]:
    compiled = []
    for ckpt_name, (param_name, shard) in tensor_map.items():
        pattern = re.escape(ckpt_name).replace(re.escape("{i}"), r"(?P<i>\d+)")
        pattern = pattern.replace(re.escape("{e}"), r"(?P<e>\d+)")   # an expert's index (MoE)
        compiled.append((re.compile(pattern + "$"), param_name, shard))
    return compiled


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 tensor_map: dict[str, tuple[str, str | None]]) -> None:
    """Copy each (checkpoint name, tensor) into the parameter (or fused shard) the map names,
    converting to the parameter's dtype; a fused parameter takes its shards or one whole
    tensor. A checkpoint's copy of a tied weight (lm_head beside embed_tokens) is skipped. The
    tensors of a quantized layer (``weight``, ``weight_scale``, ``qweight``, ...: what its method
    reads) go to its method. Fails on a tensor without a place, a shape mismatch, or a parameter
    left unloaded."""
    compiled = _compile_tensor_map(tensor_map)
    quantized = {name: m for name, m in quantized_layers(model).items() if m.quant_method.checkpoint_tensors}
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(params)
    modules = dict(model.named_modules())
    unloaded = {(name, shard) for name, p in params.items() for shard in _shards_of(modules, name)}
    for ckpt_name, tensor in weights:
        if quantized and _load_quantized(quantized, compiled, ckpt_name, tensor, type(model).__name__):
            continue
        param_name, shard = _lookup(compiled, ckpt_name, type(model).__name__)
        if param_name in aliases:
            continue
        if param_name not in params:
            raise ValueError(f"{ckpt_name} maps to {param_name}, which {type(model).__name__} does not have")
        with torch.no_grad():
            if shard is None:
                if params[param_name].shape != tensor.shape:
                    raise ValueError(f"{ckpt_name} has shape {tuple(tensor.shape)}, "
                                     f"{param_name} expects {tuple(params[param_name].shape)}")
                params[param_name].copy_(tensor)
            else:
                owner, attr = param_name.rsplit(".", 1)
                modules[owner].load_shard(shard, tensor, attr)
        filled = [shard] if shard is not None else _shards_of(modules, param_name)   # whole: every shard
        unloaded.difference_update((param_name, s) for s in filled)
    if unloaded:
        missing = sorted(f"{n}[{s}]" if s else n for n, s in unloaded)
        raise ValueError(f"checkpoint left {len(missing)} parameters unloaded: {missing[:8]}")


def _load_quantized(quantized: dict[str, nn.Module], compiled: list, ckpt_name: str, tensor: torch.Tensor,
                    model_name: str) -> bool:
    """Hand ``ckpt_name`` to its quantized layer's method when it is one of that layer's tensors
    (its place found through the layer's ``.weight`` entry); False otherwise."""
    stem, _, attr = ckpt_name.rpartition(".")
    if attr == "bias":
        return False
    try:
        param_name, shard = _lookup(compiled, f"{stem}.weight", model_name)
    except ValueError:
        return False
    layer = quantized.get(param_name.removesuffix(".weight"))
    if layer is None:
        return False
    layer.quant_method.load_weight(layer, attr, tensor, shard)
    return True


def _shards_of(modules: dict[str, nn.Module], param_name: str) -> list[str | None]:
    owner = modules[param_name.rsplit(".", 1)[0]] if "." in param_name else None
    if isinstance(owner, MergedLinear):
        return list(owner.shard_sizes)
    shards = getattr(owner, "param_shards", None)   # stacked experts (models/moe.py)
    return shards(param_name.rsplit(".", 1)[1]) if shards is not None else [None]


def _lookup(compiled: list[tuple[re.Pattern, str, str | None]], ckpt_name: str, model_name: str) -> tuple[str, str | None]:
    for pattern, param_name, shard in compiled:
        match = pattern.match(ckpt_name)
        if match:
            layer, expert = match.groupdict().get("i"), match.groupdict().get("e")
            if expert is not None:
                shard = shard.replace("{e}", expert)
            return (param_name.replace("{i}", layer) if layer is not None else param_name), shard
    raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in {model_name}")
