"""Quantization: one registry of formats (vLLM's names), one resolution path, one way for a
model's linear layers to be given their methods (models/quantization/base.py says what a format
declares).

``resolve_quantization`` builds the config from the checkpoint's ``quantization_config``
(config.json) or from ``--quantization``; ``attach_linear_methods`` gives each linear layer the
config covers its method (before the weights are read: the loader hands the layer's checkpoint
tensors to the method); ``process_weights_after_loading`` turns them into their run-time form.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.layers import Linear
from models.quantization.base import LinearMethod, QuantizationConfig, hf_layer_names
from models.quantization.formats import AWQConfig, CompressedTensorsConfig, Fp8Config, GPTQConfig
from models.quantization.gguf import GGUFConfig, GGUFInt8Config
from models.quantization.mxfp4 import Mxfp4Config

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "fp8": Fp8Config,
    "compressed-tensors": CompressedTensorsConfig,
    "awq": AWQConfig,
    "gptq": GPTQConfig,
    "mxfp4": Mxfp4Config,
    "gguf": GGUFConfig,
    "gguf-i8": GGUFInt8Config,
}
# what a checkpoint's quant_method may also be spelled as
ALIASES = {"compressed_tensors": "compressed-tensors"}

__all__ = ["QUANTIZATION_METHODS", "LinearMethod", "QuantizationConfig", "resolve_quantization",
           "attach_linear_methods", "process_weights_after_loading", "quantized_layers"]


def get_quantization_config(name: str) -> type[QuantizationConfig]:
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {name!r} is not supported; supported: {', '.join(QUANTIZATION_METHODS)}")
    return QUANTIZATION_METHODS[name]


def resolve_quantization(flag: str | None, checkpoint_config: dict[str, Any] | None, source_path: str | None,
                         device: str = "cpu", dtype: torch.dtype = torch.float32) -> QuantizationConfig | None:
    """The quantization of a model: the checkpoint's ``quantization_config`` (its quant_method
    must be registered, and agree with ``flag`` when both are given), else ``flag`` alone (the
    gguf modes; fp8 quantizes a float checkpoint at load), else None (exact)."""
    if checkpoint_config is not None:
        method = str(checkpoint_config.get("quant_method", "")).lower()
        method = ALIASES.get(method, method)
        if method not in QUANTIZATION_METHODS or method.startswith("gguf"):
            raise ValueError(f"quantization method {method!r} in config.json is not supported; supported: "
                             f"{', '.join(m for m in QUANTIZATION_METHODS if not m.startswith('gguf'))}")
        if flag is not None and flag != method:
            raise ValueError(f"--quantization {flag} does not match the checkpoint's quantization method "
                             f"{method!r} (config.json); leave --quantization out or pass {method}")
        config = QUANTIZATION_METHODS[method].from_config(checkpoint_config)
    elif flag is not None:
        config = get_quantization_config(flag).from_flag(source_path)
    else:
        return None
    config.device, config.dtype = device, dtype
    return config


def attach_linear_methods(model: nn.Module, config: QuantizationConfig, tensor_map: dict) -> int:
    """Give every linear layer ``config`` covers its method (``layer.quant_method``) and let the
    method register its checkpoint tensors; returns how many layers were given one."""
    config.prepare(model)
    count = 0
    for prefix, layer in list(model.named_modules()):
        if not isinstance(layer, Linear):
            continue
        method = config.get_quant_method(layer, prefix, hf_layer_names(tensor_map, prefix))
        if method is None:
            continue
        method.create_weights(layer)
        layer.quant_method = method
        count += 1
    return count


def quantized_layers(model: nn.Module) -> dict[str, Linear]:
    return {name: m for name, m in model.named_modules()
            if isinstance(m, Linear) and m.quant_method is not None}


def process_weights_after_loading(model: nn.Module) -> int:
    """Each quantized layer's tensors to their run-time form (a layer that becomes a packed
    module is replaced in its parent); refuses a layer whose checkpoint tensors are missing.
    Returns how many layers were processed."""
    layers = quantized_layers(model)
    missing = [f"{name}: {', '.join(m)}" for name, layer in layers.items() if (m := layer.quant_method.missing(layer))]
    if missing:
        raise ValueError(f"the checkpoint lacks quantized tensors of {len(missing)} layers: {missing[:4]}")
    for name, layer in layers.items():
        module = layer.quant_method.process_weights_after_loading(layer)
        if module is not layer:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)
    return len(layers)
