"""8-bit float conversions for the Triton kernels' fp8 KV caches, in integer arithmetic on the
cache's bytes (the cache is passed as a uint8 view): float32 -> fp8 rounds to nearest even with
the bit arithmetic of torch's .to() (c10's fp8e4m3fn / fp8e5m2_from_fp32_value), saturating at
the largest finite value (448 / 57344) as vLLM's kernels do, NaN kept; fp8 -> float32 is exact
(every byte, NaN and infinities included).

Why not ``x.to(tl.float8e4nv)``: Triton's interpreter (TRITON_INTERPRET=1, how the kernels are
tested without a GPU) gets fp8 casts wrong (subnormals flushed, no rounding to nearest, no
saturation), so these conversions are the ones tested here, and the same code runs on the GPU.

FMT: 1 = e4m3 (torch.float8_e4m3fn, bias 7, 3 mantissa bits), 2 = e5m2 (torch.float8_e5m2,
bias 15, 2 mantissa bits); 0 = not an 8-bit cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def fp8_format(dtype: torch.dtype) -> int:
    """The kernels' FMT constant of a cache dtype (0: not 8-bit)."""
    return FP8_FORMATS.get(dtype, 0)


@triton.jit
def fp8_to_float(b, FMT: tl.constexpr):
    """uint8 bytes of an 8-bit float cache -> their float32 values (exact)."""
    x = b.to(tl.uint32)
    em = x & 0x7F
    if FMT == 1:
        normal = ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        small = em.to(tl.float32) * 0.001953125                  # e == 0: m * 2^-9
        v = tl.where(em < 8, small, normal)
        v = tl.where(em == 0x7F, float("nan"), v)
    else:
        normal = ((em << 21) + (112 << 23)).to(tl.float32, bitcast=True)
        small = em.to(tl.float32) * 0.0000152587890625           # e == 0: m * 2^-16
        v = tl.where(em < 4, small, normal)
        v = tl.where(em >= 0x7C, tl.where(em == 0x7C, float("inf"), float("nan")), v)
    return tl.where((x & 0x80) != 0, -v, v)


@triton.jit
def float_to_fp8(f, FMT: tl.constexpr):
    """float32 values -> uint8 bytes of the 8-bit float: round to nearest even, saturated."""
    bits = f.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    u = bits & 0x7FFFFFFF
    if FMT == 1:
        r = u - (120 << 23)
        code = (r + 0x7FFFF + ((r >> 20) & 1)) >> 20
        code = tl.minimum(code, 0x7E)
        big = 16384.0                                              # 2^14: its ulp is 2^-9
        min_normal = 121 << 23
    else:
        r = u - (112 << 23)
        code = (r + 0xFFFFF + ((r >> 21) & 1)) >> 21
        code = tl.minimum(code, 0x7B)
        big = 128.0                                                # 2^7: its ulp is 2^-16
        min_normal = 113 << 23
    small = (u.to(tl.float32, bitcast=True) + big).to(tl.uint32, bitcast=True) - tl.full(
        u.shape, big, tl.float32).to(tl.uint32, bitcast=True)
    code = tl.where(u >= min_normal, code, small)
    code = tl.where(u > 0x7F800000, 0x7F, code)
    return (code | sign).to(tl.uint8)
