"""Int8 compute with near-float32 accuracy, as a transformation applied after loading (the
model files know nothing of it).

A plain int8 weight and a per-token int8 activation lose too much for a 135M model (one greedy
token in ten changes). Here each weight matrix is kept as two int8 matrices, a coarse one and
the rounding error of it at 1/127 of the scale, and so is each activation row, which gives
about 14 bits for both. A linear layer is then three int8 x int8 -> int32 products
(``torch._int_mm``), of which two share one call:

    y = xh Wh^T + xh Wl^T + xl Wh^T        (xl Wl^T is below float32's own rounding noise)

Int8 products run several times faster than float32 ones on AVX2 CPUs once a batch has a few
dozen rows. The LM head stays in float32: its argmax is what greedy decoding reads.
"""
from __future__ import annotations

import torch
from torch import nn

from models.layers import Linear

QUANT_MODES = ("int8", "gguf")


def _int8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q (R, C) int8, scale (R, 1) float32)."""
    scale = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(t / scale).clamp_(-127, 127).to(torch.int8), scale


def split_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """t ~= qh * sh + ql * sl, per row: the coarse int8 part and its rounding error in int8."""
    qh, sh = _int8_rows(t)
    ql, sl = _int8_rows(t - qh.float() * sh)
    return qh, sh, ql, sl


class SplitInt8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()                                    # (out, in)
        qh, sh, ql, sl = split_int8(w)
        self.out_features, self.in_features = w.shape
        self.w_both = torch.cat([qh, ql]).t().contiguous()             # (in, 2*out) int8: Wh | Wl
        self.w_high = self.w_both[:, :self.out_features]               # (in, out) view
        self.scales = torch.cat([sh, sl]).t().contiguous()             # (1, 2*out) float32
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:               # (T, in) -> (T, out)
        xh, sxh, xl, sxl = split_int8(x.float())
        n = self.out_features
        both = torch._int_mm(xh, self.w_both).float().mul_(self.scales)   # (T, 2*out)
        y = both[:, :n].add_(both[:, n:]).mul_(sxh)                     # xh Wh + xh Wl
        low = torch._int_mm(xl, self.w_high).float().mul_(self.scales[:, :n])
        y.addcmul_(low, sxl)                                            # + xl Wh
        if self.bias is not None:
            y.add_(self.bias)
        return y


def quantize(model: nn.Module, mode: str, gguf_path: str | None = None,
             skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Transform ``model`` in place.

    ``int8``: every linear layer but those named in ``skip`` runs split-int8 products.
    ``gguf``: layers stored as Q4_1 / Q8_0 in the GGUF file run those blocks natively for small
    batches (exact weights, float32 activations) and split-int8 (the LM head: float32) for
    large ones; single-stream decode reads a sixth of float32's weight bytes.
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r}; supported: {', '.join(QUANT_MODES)}")
    if not hasattr(torch, "_int_mm"):
        raise ValueError("int8 products need torch._int_mm, which this PyTorch lacks")
    if mode == "gguf":
        return _quantize_gguf(model, gguf_path, skip)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Linear) and name not in skip:
                setattr(module, name, SplitInt8Linear(child.weight, child.bias))
    return model


def _quantize_gguf(model: nn.Module, gguf_path: str | None, skip: tuple[str, ...]) -> nn.Module:
    from kernels.cpu.native import available
    from models.gguf_header import read_gguf
    from models.gguf_native import run_natively
    ok, reason = available()
    if not ok:
        raise ValueError(f"the gguf quantization mode needs the native CPU kernels: {reason}")
    if gguf_path is None or not gguf_path.endswith(".gguf"):
        raise ValueError("the gguf quantization mode needs a model loaded from a .gguf file")

    def fallback(name: str, linear: Linear) -> nn.Module:
        leaf = name.rsplit(".", 1)[-1]
        return linear if leaf in skip else SplitInt8Linear(linear.weight, linear.bias)
    run_natively(model, read_gguf(gguf_path), model.config, fallback)
    return model
