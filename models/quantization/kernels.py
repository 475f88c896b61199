"""The run-time forms of quantized linear layers, shared by the formats: every format turns its
checkpoint tensors into one of

- integer codes with scales (``IntWeights``): int8 W8A8, and AWQ / GPTQ int4 once unpacked, the
  zero point subtracted (codes q - z in -15..15 fit int8 exactly);
- fp8 codes with float32 scales per output feature (``Fp8Weights``);

and runs it on the CPU through the native panel kernels (kernels/cpu/gemm.c, what gguf and
gguf-i8 run) or on CUDA through the Triton kernels of kernels/triton/quant.py.

On the CPU, integer codes become Q8_0 blocks of 32 input features with the scale of the block's
group (per channel: one scale a row) in float16: AWQ's and GPTQ's scales are float16, so their
weights are the checkpoint's exactly; float32 scales (int8 W8A8) are rounded to float16 (a
relative change of at most 2^-11 per output feature, far below int8's own step). W8A8 layers
take int8 activations in two parts per block of 32 (gguf-i8's int8 kernel; finer than
one scale per token), W4A16 layers float32 activations. Layers the blocks cannot hold (an input
size not a multiple of 32, a scale outside float16's normal range, GPTQ's act-order groups
scattered over the input features) and fp8 weights are dequantized at load to float32 (exactly
the checkpoint's values, up to float32 rounding of code * scale) and packed as float panels.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from models.quantization.base import LinearMethod, shards_of

QK = 32                         # input features per Q8_0 block
FP16_MIN_NORMAL, FP16_MAX = 2.0 ** -14, 65504.0


@dataclass
class IntWeights:
    """w[n, k] = codes[n, k] * scales[n, g_idx[k]] (+ bias)."""
    codes: torch.Tensor             # (N, K) int8
    scales: torch.Tensor            # (N, G) float32 or float16: G groups of the input features
    g_idx: torch.Tensor | None      # (K,) int32 group of each input feature; None: k // (K / G)
    int8_activations: bool          # W8A8: the activations are quantized too
    zeros: torch.Tensor | None = None   # (N, G) int8: int4's zero points (codes = q - zero)

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def group_index(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.codes.shape[1]) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        return self.codes.float() * self.scales.float()[:, self.group_index()]

    @staticmethod
    def cat(parts: list["IntWeights"]) -> "IntWeights":
        """Shards stacked along the output features (same groups)."""
        first = parts[0]
        if len(parts) == 1:
            return first
        if any(p.scales.shape[1] != first.scales.shape[1] for p in parts):
            raise ValueError("the shards of a fused layer have different scale groups")
        g = [p.g_idx for p in parts]
        if any((a is None) != (g[0] is None) or (a is not None and not torch.equal(a, g[0])) for a in g):
            raise ValueError("the shards of a fused layer have different act-order groups (g_idx)")
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        return IntWeights(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          first.g_idx, first.int8_activations, zeros)


@dataclass
class Fp8Weights:
    """w[n, k] = fp8 codes[n, k] * scale[n]."""
    codes: torch.Tensor             # (N, K) float8_e4m3fn
    scale: torch.Tensor             # (N,) float32
    input_scale: torch.Tensor | None  # () float32: static activation scale; None: dynamic per token

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale[:, None]

    @staticmethod
    def cat(parts: list["Fp8Weights"]) -> "Fp8Weights":
        inputs = [p.input_scale for p in parts]
        if any((s is None) != (inputs[0] is None) for s in inputs):
            raise ValueError("the shards of a fused layer mix static and dynamic activation scales")
        return Fp8Weights(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          None if inputs[0] is None else torch.stack(inputs).max())


def per_feature_scale(scale: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """A per-tensor ((), (1,)) or per-channel ((N,), (N, 1)) scale as (N,) float32."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).clone()
    if s.numel() != rows:
        raise ValueError(f"{what} has {s.numel()} values; expected 1 (per tensor) or {rows} (per channel)")
    return s


def q8_0_blocks(w: IntWeights) -> np.ndarray | None:
    """The GGUF Q8_0 bytes (N, K / 32 * 34) of ``w``, or None when the blocks cannot hold it: each
    block of 32 inputs takes the scale of its group, so every block must lie within one group
    (groups of a multiple of 32, or a tensor-parallel rank's run of them starting mid-group)."""
    n, k = w.codes.shape
    if k % QK:
        return None
    groups = w.group_index().reshape(-1, QK)
    if not bool((groups == groups[:, :1]).all()):
        return None
    scales = w.scales.float()
    if not bool(((scales.abs() >= FP16_MIN_NORMAL) & (scales.abs() <= FP16_MAX)).all()):
        return None
    d = scales[:, groups[:, 0]].to(torch.float16).numpy()                              # (N, K / 32)
    blocks = np.empty((n, k // QK, 34), np.uint8)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, k // QK, 2)
    blocks[..., 2:] = w.codes.numpy().view(np.uint8).reshape(n, k // QK, QK)
    return blocks.reshape(n, -1)


def group_columns(groups: torch.Tensor, cols: tuple[int, int]) -> tuple[slice, torch.Tensor]:
    """A run of input features (first, count) of a layer whose inputs are in ``groups`` (K,):
    (the run of groups it touches, each of its inputs' group within that run)."""
    c0, n = cols
    part = groups[c0:c0 + n].long()
    lo, hi = int(part.min()), int(part.max())
    return slice(lo, hi + 1), part - lo


def natural_groups(groups: torch.Tensor | None, k: int, count: int) -> torch.Tensor | None:
    """``groups`` (K,), or None when it is the layout k // (K / count) that IntWeights assumes."""
    if groups is None or k % count == 0 and torch.equal(groups.long(), torch.arange(k) // (k // count)):
        return None
    return groups.to(torch.int32)


def cpu_module(weights: IntWeights | Fp8Weights, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """The module that runs a quantized layer on the CPU: Q8_0 panels where they hold the weights
    exactly (see the module docstring), else a float layer of the dequantized weights (packed
    later with the other float layers)."""
    from kernels.cpu.native import available
    from models.layers import Linear
    if isinstance(weights, IntWeights) and available()[0]:
        blocks = q8_0_blocks(weights)
        if blocks is not None:
            from kernels.cpu.panels import PanelWeight, int8_available
            from models.packed import PanelLinear
            n, k = weights.codes.shape
            i8 = weights.int8_activations and int8_available()
            return PanelLinear(PanelWeight.pack_gguf("Q8_0", blocks, n, k, i8), bias)
    w = weights.dequantize()
    layer = Linear(w.shape[1], w.shape[0], dtype, bias=bias is not None)
    layer.weight.data.copy_(w)
    if bias is not None:
        layer.bias.data.copy_(bias)
    return layer


class PackedLinearMethod(LinearMethod):
    """The safetensors formats' methods: ``unpack`` (the format's reading of the loaded
    tensors) gives ``IntWeights`` or ``Fp8Weights``, which become the CPU module or, on CUDA, the
    layer's buffers for the Triton kernels (``apply``).

    A tensor-parallel rank's part (``shard``) takes its rows or columns of each loaded tensor
    (``part_tensors``, per format); a run of inputs that starts or ends inside a group of the
    format's scales keeps the groups it touches and says which of them each input is in
    (``groups``)."""
    groups: torch.Tensor | None = None      # a part's (K,) group of each input feature; None: the format's

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    def unpack(self, layer: nn.Module) -> IntWeights | Fp8Weights:
        raise NotImplementedError

    def part_tensors(self, tensors: dict[str, torch.Tensor], rows: tuple[int, int] | None,
                     cols: tuple[int, int] | None) -> dict[str, torch.Tensor]:
        """One shard's loaded tensors (by name) -> those of its (first, count) output rows or input
        columns; sets ``groups`` where the columns cut the format's groups."""
        raise ValueError(f"{type(self).__name__} weights are not split over tensor-parallel ranks")

    def shard(self, whole: nn.Module, part: nn.Module, rows: dict[str | None, tuple[int, int]] | None = None,
              cols: tuple[int, int] | None = None) -> None:
        method = copy.copy(self)
        part.quant_tensors = {}
        for shard in shards_of(whole):
            tensors = {name: t for (name, s), t in whole.quant_tensors.items() if s == shard}
            for name, t in method.part_tensors(tensors, rows[shard] if rows is not None else None, cols).items():
                part.quant_tensors[(name, shard)] = t.contiguous()
        if self.checkpoint_tensors:
            del part.weight
            part.weight = None
        part.quant_method = method

    def process_weights_after_loading(self, layer: nn.Module) -> nn.Module:
        weights = self.unpack(layer)
        layer.quant_tensors = {}
        bias = None if layer.bias is None else layer.bias.detach()
        if self.device == "cpu":
            return cpu_module(weights, bias, self.dtype)
        install_gpu_weights(layer, weights)
        return layer

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from kernels.triton import quant
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        custom_op = getattr(layer, "custom_ops", True)       # set_custom_ops: False at -O0 and -O3
        if layer.q_kind == "fp8":
            y = quant.fp8_linear(x2, layer.q_codes, layer.q_scale, layer.q_input_scale, x.dtype, custom_op)
        elif layer.q_kind == "int8":
            y = quant.int8_linear(x2, layer.q_codes, layer.q_scale, x.dtype, custom_op)
        else:
            y = quant.ops().int4_linear(x2, layer.q_codes, layer.q_zeros, layer.q_scale, layer.q_g_idx,
                                         layer.q_group, x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*shape[:-1], y.shape[-1])


def install_gpu_weights(layer: nn.Module, weights: IntWeights | Fp8Weights) -> None:
    """The CUDA form: buffers of the layer (moved with it), named ``q_*``, for
    kernels/triton/quant.py."""
    from kernels.triton import quant
    if isinstance(weights, Fp8Weights):
        layer.register_buffer("q_codes", weights.codes.view(torch.uint8).contiguous())
        layer.register_buffer("q_scale", weights.scale.float().contiguous())
        layer.register_buffer("q_input_scale", weights.input_scale)
        layer.q_kind = "fp8"
    elif weights.int8_activations:
        if weights.scales.shape[1] != 1:
            raise ValueError("int8 weights with group scales run on the CPU only (the CUDA kernel takes one scale "
                             "per output feature)")
        layer.register_buffer("q_codes", weights.codes.contiguous())
        layer.register_buffer("q_scale", weights.scales.float().reshape(-1).contiguous())
        layer.q_kind = "int8"
    else:
        if weights.zeros is None:
            raise ValueError("int4 weights on CUDA need their zero points")
        g = weights.group_index()
        q = weights.codes.int() + weights.zeros.int()[:, g]                       # (N, K) 0..15
        layer.register_buffer("q_codes", quant.pack_int4(q.t().contiguous()))   # (K / 8, N) int32
        layer.register_buffer("q_zeros", weights.zeros.t().contiguous().to(torch.int8))   # (G, N)
        layer.register_buffer("q_scale", weights.scales.t().contiguous().to(torch.float16))  # (G, N)
        layer.register_buffer("q_g_idx", g.to(torch.int32))
        layer.q_group = weights.group_size if weights.g_idx is None else 0     # 0: act-order groups
        layer.q_kind = "int4"
