"""Linear layers with their weights packed once for the CPU, as a transformation applied after
loading (the model files know nothing of it).

Float32 weights go to the native panel kernel of ``kernels/cpu/gemm.c`` (as float32, or rounded
to bfloat16 for the CPU's ``--dtype bfloat16``) (same float32 products,
each output summed in input-feature order; about 1.5x oneDNN's speed at decode batch sizes on
AVX-512 CPUs, a little faster at prefill sizes too). bfloat16 weights, and float32 ones where
the native kernels cannot be built, go to oneDNN's blocked layout (``torch.ops.mkldnn``), which
is still about twice the plain matmul's speed.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.cpu import fused
from kernels.cpu.panels import gated_matmul, matmul
from models.layers import Linear


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = weight.detach().to_mkldnn()                     # (out, in), blocked layout
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:              # (T, in) -> (T, out)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PanelLinear(nn.Module):
    """y = x W^T (+ b) through the native panel kernel; W float32 or GGUF Q4_1 / Q8_0 panels."""

    def __init__(self, weight, bias: torch.Tensor | None) -> None:   # weight: kernels.cpu.panels.PanelWeight
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:              # (..., in) -> (..., out)
        if torch.compiler.is_compiling():
            y = _traced_matmul(x.reshape(-1, self.in_features), self.weight)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        if x.dim() == 2:                 # the bias added by the kernel, tile by tile
            return matmul(x, self.weight, self.bias)
        return matmul(x.reshape(-1, self.in_features), self.weight, self.bias).reshape(*x.shape[:-1],
                                                                                       self.out_features)

    def act_forward(self, x: torch.Tensor, act: str, bfloat16_out: bool = False) -> torch.Tensor | None:
        """act(self(x)) for x (T, in) in one native pass, the activation (kernels/cpu/fused.py's
        ACTIVATIONS) applied to each tile as it is written: bit for bit ``fused.activation`` of
        ``self(x)``; None where the caller should take the two-step path (as torch.compile does).
        ``bfloat16_out``: bfloat16 weights write it in bfloat16, rounded as the next bfloat16
        layer would round it (for that layer only: the CPU's --dtype bfloat16)."""
        if x.dim() != 2 or not fused.ENABLED or torch.compiler.is_compiling():
            return None
        return matmul(x, self.weight, self.bias, act, out_bf16=bfloat16_out)

    def residual_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """residual + self(x) for x (T, in) in one native pass, the residual added to each tile
        as it is written: bit for bit ``residual + self(x)``; None where the caller should take
        the two-step path."""
        if x.dim() != 2 or not fused.ENABLED or torch.compiler.is_compiling() or not fused.supports(residual) \
                or not residual.is_contiguous():
            return None
        return matmul(x, self.weight, self.bias, residual=residual)

    def gated_act_forward(self, x: torch.Tensor, act: str, bfloat16_out: bool = False) -> torch.Tensor | None:
        """For a gate|up projection: act(gate) * up in one native pass (kernels/cpu/panels.py
        gated_matmul), bit for bit ``fused.gated_activation(self(x), act)``; None when there is no
        such kernel for these weights (the caller takes the two-step path, as torch.compile does).
        ``bfloat16_out``: as ``act_forward``'s."""
        if self.bias is not None or x.dim() != 2 or not fused.ENABLED or torch.compiler.is_compiling():
            return None
        return gated_matmul(x, self.weight, act, out_bf16=bfloat16_out)

    def extra_repr(self) -> str:
        return f"{self.weight.kind}, in={self.in_features}, out={self.out_features}"


def _traced_matmul(x: torch.Tensor, w) -> torch.Tensor:
    """``matmul`` through its custom op (torch.ops.troupe.cpu_panel_matmul), which torch.compile
    traces as one node instead of breaking its graph at the ctypes call."""
    return torch.ops.troupe.cpu_panel_matmul(x.to(torch.float32).contiguous(), w.codes, w.d, w.m, w.kind,
                                             w.out_features, w.in_features)


def native_available() -> bool:
    from kernels.cpu.native import available
    return available()[0]


def bfloat16_experts(model: nn.Module) -> int:
    """The CPU's ``--dtype bfloat16`` for mixtures of experts: each FusedMoE's float32 stacked
    expert weights rounded to bfloat16 (the native MoE kernel's bfloat16 products: half the bytes
    to read); returns how many layers."""
    from models.moe import FusedMoE
    n = 0
    for m in model.modules():
        if isinstance(m, FusedMoE) and m.w13_weight.dtype == torch.float32 and m.w13_weight.device.type == "cpu":
            m.w13_weight = nn.Parameter(m.w13_weight.detach().to(torch.bfloat16), requires_grad=False)
            m.w2_weight = nn.Parameter(m.w2_weight.detach().to(torch.bfloat16), requires_grad=False)
            n += 1
    return n


def prepack_linears(model: nn.Module, bfloat16: bool = False) -> int:
    """Replace every float32 / bfloat16 ``Linear`` on the CPU; returns how many. ``bfloat16``:
    float32 weights become bfloat16 panels (the CPU's ``--dtype bfloat16``), and the experts'
    stacked weights bfloat16 (``bfloat16_experts``)."""
    native = native_available()
    if bfloat16 and native and fused.ENABLED:
        bfloat16_experts(model)
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, Linear) or child.quant_method is not None or child.weight.device.type != "cpu":
                continue
            if child.weight.dtype == torch.float32 and native:
                from kernels.cpu.panels import PanelWeight
                pack = PanelWeight.pack_bf16 if bfloat16 else PanelWeight.pack_f32
                packed: nn.Module = PanelLinear(pack(child.weight), child.bias)
            elif child.weight.dtype in (torch.float32, torch.bfloat16) and onednn_available():
                packed = OneDNNLinear(child.weight, child.bias)
            else:
                continue
            setattr(module, name, packed)
            replaced += 1
    return replaced
