"""8-bit float KV caches (``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2``, vLLM's names and meaning):
K and V stored as torch.float8_e4m3fn or torch.float8_e5m2 with one scale per layer for the keys and
one for the values (vLLM's ``k_scale`` / ``v_scale``):

    stored = fp8(x / scale)      rounded to nearest even, saturated at the largest finite value
    read   = float32(stored) * scale

Every path that writes or reads such a cache (the native kernels, the torch paths, the Triton
kernels and the references they are tested against) does exactly this; the torch versions live here.
The scales are 1.0 unless calibrated (``--calculate-kv-scales``: the first batch's key amax / 200
and value amax / 100, per layer, vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT, for either format).
"""
from __future__ import annotations

import torch

# The largest finite value of each format: saturation bound, and the calibration's divisor.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

# vLLM's --calculate-kv-scales divisors (vllm/envs.py K_SCALE_CONSTANT, V_SCALE_CONSTANT): a scale is
# amax / divisor, whatever the fp8 format, so later keys up to 448 / 200 = 2.24x the first batch's
# largest (values: 4.48x) still fit e4m3 unsaturated.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0

# --kv-cache-dtype names -> torch dtypes ("fp8" is e4m3, as in vLLM).
FP8_NAMES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """x as the cache stores it: fp8(x / scale) saturated for an 8-bit dtype (in float32, so
    bit for bit what the kernels store), a plain cast for the others (the scale unused)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    y = x.float()
    if scale is not None:
        y = y / scale
    bound = FP8_MAX[dtype]
    return y.clamp(-bound, bound).to(dtype)       # clamp keeps NaN, and saturates e5m2 as e4m3fn is


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | float | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache values as attention reads them: float32(x) * scale for an 8-bit cache (then cast to
    ``dtype``), a plain cast for the others."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    y = x.float()
    if scale is not None:
        y = y * scale
    return y.to(dtype)


def calibrated_scale(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """vLLM's --calculate-kv-scales: amax(|x|) / divisor (K_SCALE_CONSTANT for keys,
    V_SCALE_CONSTANT for values); a float32 0-dim tensor on x's device, 1.0 when x is all zeros."""
    amax = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    return torch.where(amax > 0, amax / divisor, torch.ones_like(amax))


def store_rows_(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                scale: torch.Tensor | float | None = None) -> None:
    """flat[slots] = rows as the cache stores them (quantize_kv), flat (N, ...) any cache dtype.
    8-bit rows are written through a uint8 view (torch has no index_copy_ for them)."""
    q = quantize_kv(rows, flat.dtype, scale)
    if is_fp8(flat.dtype):
        flat.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, q)
