"""The architecture registry (keyed by Hugging Face architecture name) and ``load_model``,
which builds a model and dispatches checkpoint tensors onto it through the model's tensor map."""
from __future__ import annotations

import re
from typing import Iterable, NamedTuple

import torch
from torch import nn

from kernels.attention import AttentionBackend, CpuAttentionBackend
from models.config import ModelConfig
from models.gguf_loader import gguf_model_config, iter_gguf_weights, read_gguf
from models.llama import LlamaForCausalLM
from models.layers import MergedLinear
from models.resolve import ModelSource

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


class LoadedModel(NamedTuple):
    model: nn.Module
    config: ModelConfig


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32,
               attn_backend: AttentionBackend | None = None) -> LoadedModel:
    """Build the model for ``source`` with its weights, in eval mode, on the CPU
    (attention through ``attn_backend``, by default the CPU backend)."""
    if source.kind != "gguf":
        raise ValueError(f"loading a {source.kind!r} model ({source.path}) is not supported yet; "
                         "supported: a .gguf file")
    attn_backend = attn_backend or CpuAttentionBackend()
    gguf = read_gguf(source.path)
    config = gguf_model_config(gguf)
    model = get_model_class(config.architecture)(config, attn_backend, dtype)
    load_weights(model, iter_gguf_weights(gguf, config), model.gguf_tensor_map)
    return LoadedModel(model.eval(), config)


def _compile_tensor_map(tensor_map: dict[str, tuple[str, str | None]]) -> list[tuple[re.Pattern, str, str | None]]:
    compiled = []
    for ckpt_name, (param_name, shard) in tensor_map.items():
        pattern = re.escape(ckpt_name).replace(re.escape("{i}"), r"(?P<i>\d+)")
        compiled.append((re.compile(pattern + "$"), param_name, shard))
    return compiled


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 tensor_map: dict[str, tuple[str, str | None]]) -> None:
    """Copy each (checkpoint name, tensor) into the parameter (or fused shard) the map names.
    Fails on a tensor without a place, a shape mismatch, or a parameter left unloaded."""
    compiled = _compile_tensor_map(tensor_map)
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    modules = dict(model.named_modules())
    unloaded = {(name, shard) for name, p in params.items() for shard in _shards_of(modules, name)}
    for ckpt_name, tensor in weights:
        param_name, shard = _lookup(compiled, ckpt_name, type(model).__name__)
        if param_name not in params:
            raise ValueError(f"{ckpt_name} maps to {param_name}, which {type(model).__name__} does not have "
                             "(a tied weight given twice?)")
        with torch.no_grad():
            if shard is None:
                if params[param_name].shape != tensor.shape:
                    raise ValueError(f"{ckpt_name} has shape {tuple(tensor.shape)}, "
                                     f"{param_name} expects {tuple(params[param_name].shape)}")
                params[param_name].copy_(tensor)
            else:
                modules[param_name.rsplit(".", 1)[0]].load_shard(shard, tensor)
        unloaded.discard((param_name, shard))
    if unloaded:
        missing = sorted(f"{n}[{s}]" if s else n for n, s in unloaded)
        raise ValueError(f"checkpoint left {len(missing)} parameters unloaded: {missing[:8]}")


def _shards_of(modules: dict[str, nn.Module], param_name: str) -> list[str | None]:
    owner = modules[param_name.rsplit(".", 1)[0]] if "." in param_name else None
    return list(owner.shard_sizes) if isinstance(owner, MergedLinear) else [None]


def _lookup(compiled: list[tuple[re.Pattern, str, str | None]], ckpt_name: str, model_name: str) -> tuple[str, str | None]:
    for pattern, param_name, shard in compiled:
        match = pattern.match(ckpt_name)
        if match:
            layer = match.groupdict().get("i")
            return (param_name.replace("{i}", layer) if layer is not None else param_name), shard
    raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in {model_name}")
