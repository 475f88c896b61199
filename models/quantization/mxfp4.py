"""MXFP4 (OCP microscaling FP4), as gpt-oss's checkpoints hold their experts: each weight row
in blocks of 32 values, two 4-bit E2M1 codes a byte (the low nibble first) and one E8M0 scale a
block (a power of two, 2^(byte - 127)). ``quant_method: "mxfp4"`` covers the mixture-of-experts
weights only (the attention, router, embeddings and head stay float): a model that reads it
(``reads_mxfp4``) dequantizes each expert tensor at load into its own dtype, where the fused
MoE kernels run it (no FP4 matmul kernel here)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.layers import Linear
from models.quantization.base import LinearMethod, QuantizationConfig

# E2M1: sign, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (..., G, 16) uint8 codes and scales (..., G) uint8 exponents -> (..., G * 32) in
    ``dtype``: value j of a block is FP4_VALUES[code] * 2^(scale - 127), codes low nibble first."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks (..., G, 16) and scales (..., G) do not match: {tuple(blocks.shape)} "
                         f"and {tuple(scales.shape)}")
    codes = blocks.to(torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)   # (..., G, 16, 2)
    values = values.flatten(-2) * torch.exp2(scales.to(torch.float32) - 127)[..., None]   # (..., G, 32)
    return values.flatten(-2).to(dtype)


class Mxfp4Config(QuantizationConfig):
    """config.json's ``quant_method: "mxfp4"``: no linear layer is given a method; the model's
    experts are dequantized as they are read (the model says it can: ``reads_mxfp4``)."""
    name = "mxfp4"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Mxfp4Config":
        return cls()

    def prepare(self, model: nn.Module) -> None:
        if not getattr(model, "reads_mxfp4", False):
            raise ValueError(f"MXFP4 checkpoints are read for gpt-oss (GptOssForCausalLM), not "
                             f"{type(model).__name__}")

    def get_quant_method(self, layer: Linear, prefix: str, hf_names: dict[str | None, str]) -> LinearMethod | None:
        return None
