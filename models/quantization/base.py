"""What a quantization format declares (vLLM's ``QuantizationConfig`` and ``LinearMethodBase``):
a ``QuantizationConfig`` is built from a checkpoint's ``quantization_config`` (config.json) or
from ``--quantization``, says which linear layers it covers and gives each a ``LinearMethod``;
the method registers the layer's checkpoint tensors, takes them as the loader reads them, turns
them into their run-time form once loading is done and multiplies by them. The model code only
calls its layers.

Layers are named as in our models ("layers.3.self_attn.qkv_proj", a fused layer with its
shards "q", "k", "v"); ``hf_names`` gives the checkpoint's names of a layer's shards
("model.layers.3.self_attn.q_proj"), which is what ignore lists name.
"""
from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import nn

from models.layers import Linear, MergedLinear


class QuantizationConfig:
    """One checkpoint's (or one flag's) quantization. Subclasses set ``name`` (vLLM's
    quant_method) and implement ``from_config`` and ``get_quant_method``."""
    name: ClassVar[str]
    device: str = "cpu"     # where the model runs (set before layers are given methods)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantizationConfig":
        """From config.json's ``quantization_config`` (refusing what is not supported, by name)."""
        raise NotImplementedError

    @classmethod
    def from_flag(cls, source_path: str) -> "QuantizationConfig":
        """From ``--quantization`` alone, for a checkpoint without a quantization_config."""
        raise ValueError(f"--quantization {cls.name} needs a checkpoint quantized as {cls.name} "
                         f"(its config.json's quantization_config); {source_path} has none")

    def prepare(self, model: nn.Module) -> None:
        """Called once with the built model, before any layer is asked for."""

    def get_quant_method(self, layer: Linear, prefix: str, hf_names: dict[str | None, str]
                         ) -> "LinearMethod | None":
        """The method of the layer named ``prefix`` (None: it stays a float layer)."""
        raise NotImplementedError


class LinearMethod:
    """How one linear layer's weights are stored, loaded and multiplied.

    ``checkpoint_tensors``: the names (beside ``bias``) this method reads per shard, e.g.
    ("weight", "weight_scale"); ``optional_tensors`` may be absent. Methods that read none (an
    empty tuple) keep the layer's float parameters, loaded as for an exact model."""
    checkpoint_tensors: tuple[str, ...] = ()
    optional_tensors: tuple[str, ...] = ()

    def create_weights(self, layer: Linear) -> None:
        """Drop the float weight the layer was built with; its checkpoint tensors arrive through
        ``load_weight`` (kept on the layer, by (name, shard), until processed)."""
        if not self.checkpoint_tensors:
            return
        del layer.weight
        layer.weight = None
        layer.quant_tensors = {}

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        if name not in self.checkpoint_tensors + self.optional_tensors:
            raise ValueError(f"{type(self).__name__} does not read a tensor named {name!r}; it reads "
                             f"{', '.join(self.checkpoint_tensors + self.optional_tensors)}")
        layer.quant_tensors[(name, shard)] = tensor

    def missing(self, layer: Linear) -> list[str]:
        """The required checkpoint tensors still missing, as "name[shard]"."""
        have = getattr(layer, "quant_tensors", {})
        return [f"{n}[{s}]" if s else n for s in shards_of(layer) for n in self.checkpoint_tensors
                if (n, s) not in have]

    def process_weights_after_loading(self, layer: Linear) -> nn.Module:
        """Turn the loaded tensors into their run-time form; returns the module that runs the
        layer from now on: the layer itself (``forward`` calls ``apply``), or, on the CPU, a
        packed module for the native kernels."""
        return layer

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no apply")

    def shard(self, whole: Linear, part: Linear, rows: dict[str | None, tuple[int, int]] | None = None,
              cols: tuple[int, int] | None = None) -> None:
        """Give ``part``, a tensor-parallel rank's share of layer ``whole`` (built by
        models/tensor_parallel.py, with float weights of its shape where ``whole`` keeps float
        weights), its method and its share of the loaded checkpoint tensors, before they are
        processed: per shard, (first row, rows) of its output rows (column-parallel), or (first
        column, columns) of its inputs (row-parallel). ValueError when the format cannot be split
        so."""
        raise ValueError(f"{type(self).__name__} weights are not split over tensor-parallel ranks")


def shards_of(layer: nn.Module) -> list[str | None]:
    return list(layer.shard_sizes) if isinstance(layer, MergedLinear) else [None]


def shard_tensors(layer: Linear, name: str) -> list[torch.Tensor | None]:
    """The loaded tensor ``name`` of each shard, in shard order (None where absent)."""
    return [layer.quant_tensors.get((name, s)) for s in shards_of(layer)]


def hf_layer_names(tensor_map: dict[str, tuple[str, str | None]], prefix: str) -> dict[str | None, str]:
    """shard -> the checkpoint's module name of layer ``prefix`` ({} when the map has none)."""
    names: dict[str | None, str] = {}
    for ckpt_name, (param, shard) in tensor_map.items():
        if not (param.endswith(".weight") and ckpt_name.endswith(".weight")):
            continue
        pattern = re.escape(param.removesuffix(".weight")).replace(re.escape("{i}"), r"(?P<i>\d+)")
        match = re.fullmatch(pattern, prefix)
        if match:
            stem = ckpt_name.removesuffix(".weight")
            names[shard] = stem.replace("{i}", match.group("i")) if "{i}" in stem else stem
    return names


def is_ignored(hf_names: dict[str | None, str], prefix: str, ignore: list[str],
               match: str = "exact") -> bool:
    """Whether an ignore list leaves the layer unquantized: every shard named in it. Entries are
    module names, "re:<regex>" (compressed-tensors), or, with ``match="substring"``, parts of a
    name (AWQ's modules_to_not_convert). A fused layer with only some shards ignored is refused."""
    names = list(hf_names.values()) or [prefix]

    def hit(name: str) -> bool:
        for entry in ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], name) or re.fullmatch(entry[3:], name.split(".")[-1]):
                    return True
            elif match == "substring" and entry in name:
                return True
            elif name == entry or name.endswith("." + entry):
                return True
        return False
    hits = [hit(n) for n in names]
    if any(hits) and not all(hits):
        raise ValueError(f"the ignore list leaves some of {names} unquantized but not all; a fused layer "
                         f"({prefix}) is quantized whole or not at all")
    return all(hits)
