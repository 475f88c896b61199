"""Int8 weights with dynamic int8 activations, as a transformation applied after loading
(the model files know nothing of it).

Every linear layer (fused ones and the LM head included) keeps its weight as per-output-channel
symmetric int8; each forward quantizes its input per token (per row) on the fly, multiplies
int8 x int8 into int32 (``torch._int_mm``) and rescales. Weights take a quarter of float32's
memory traffic and the integer matmul runs several times faster than float32 on AVX2 CPUs.
Per-token activation scales keep one outlier token from coarsening the whole batch.
"""
from __future__ import annotations

import torch
from torch import nn

from models.layers import Linear

QUANT_MODES = ("int8",)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> (in, out) int8 (transposed for the matmul) and (out,) float32 scales."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0                       # (out,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)       # (out, in)
    return q.t().contiguous(), scale


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.empty(0, dtype=torch.int8), persistent=False)
        self.qweight, self.wscale = quantize_weight(weight)                     # (in, out), (out,)
        self.bias = None if bias is None else bias.detach().float()
        self.in_features, self.out_features = self.qweight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:                         # (T, in) -> (T, out)
        x = x.float()
        xscale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0      # (T, 1)
        xq = torch.round(x / xscale).to(torch.int8)                             # (T, in)
        y = torch._int_mm(xq, self.qweight).float()                             # (T, out) int32 -> f32
        y.mul_(xscale).mul_(self.wscale)
        if self.bias is not None:
            y.add_(self.bias)
        return y


def quantize(model: nn.Module, mode: str) -> nn.Module:
    """Replace every ``Linear`` of ``model`` in place; returns the model."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r}; supported: {', '.join(QUANT_MODES)}")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Linear):
                setattr(module, name, Int8Linear(child.weight, child.bias))
    return model
