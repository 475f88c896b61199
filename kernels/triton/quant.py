"""Quantized matrix multiplies for the GPU path of models/quantization (CUDA tensors), with
their torch references (dequantize, then matmul):

- ``per_token_quant``: activations (M, K) -> 8-bit codes (fp8 e4m3 bytes or int8) and one
  float32 scale per row (amax / 448 or amax / 127): vLLM's dynamic per-token activations.
- ``scaled_mm``: 8-bit codes A (M, K) times B (N, K)^T, times a_scale[m] * b_scale[n]: W8A8
  (fp8 or int8). The codes are widened to float32 in registers for a float32 dot (tf32 on
  tensor cores, whose 10-bit mantissa holds every fp8 e4m3 and int8 value exactly) with float32
  accumulation: the products and sums of an 8-bit MMA, on any tensor-core generation, and
  testable under Triton's interpreter, which gets fp8 casts and bfloat16 dots wrong
  (kernels/triton/fp8.py converts the bytes itself).
- ``int4_matmul``: x (M, K) times int4 weights packed 8 to an int32 along K (GPTQ's layout;
  AWQ's is reordered at load), w[k, n] = (q - zero[g, n]) * scale[g, n] with g = g_idx[k]
  (act-order groups included), dequantized tile by tile in registers (W4A16).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton import dot_precision
from kernels.triton.fp8 import float_to_fp8, fp8_to_float

FP8_MAX, INT8_MAX = 448.0, 127.0
FMT_INT8, FMT_FP8 = 0, 1       # the codes' format (FMT_FP8: kernels/triton/fp8.py's e4m3)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + m * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    qmax = 448.0 if FMT == 1 else 127.0
    scale = tl.maximum(amax / qmax, 1e-12)
    v = x / scale
    if FMT == 1:
        q = float_to_fp8(v, 1)
    else:
        q = tl.minimum(tl.maximum(tl.floor(v + 0.5), -127.0), 127.0).to(tl.int8)
    tl.store(q_ptr + m * K + k, q, mask=k < K)
    tl.store(s_ptr + m, scale)


def per_token_quant(x: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (codes (M, K): fp8 e4m3 bytes as uint8, or int8; scales (M,) float32)."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.uint8 if fmt == FMT_FP8 else torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        _per_token_quant_kernel[(M,)](x, q, s, K, x.stride(0), FMT=fmt, BLOCK_K=triton.next_power_of_2(K))
    return q, s


def per_token_quant_ref(x: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = (xf.abs().amax(dim=1) / (FP8_MAX if fmt == FMT_FP8 else INT8_MAX)).clamp(min=1e-12)
    v = xf / scale[:, None]
    if fmt == FMT_FP8:
        return v.to(torch.float8_e4m3fn).view(torch.uint8), scale
    return torch.floor(v + 0.5).clamp(-127, 127).to(torch.int8), scale


@triton.jit
def _widen(codes, FMT: tl.constexpr):
    if FMT == 1:
        return fp8_to_float(codes, 1)
    return codes.to(tl.float32)


@triton.jit
def _scaled_mm_kernel(a_ptr, b_ptr, as_ptr, bs_ptr, out_ptr, M, N, K, FMT: tl.constexpr, NATIVE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    if NATIVE and FMT == 0:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + m[:, None].to(tl.int64) * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                    other=0)
        b = tl.load(b_ptr + n[None, :].to(tl.int64) * K + k[:, None], mask=(n[None, :] < N) & (k[:, None] < K),
                    other=0)
        if NATIVE:            # the tensor cores' own 8-bit MMA: fp8 e4m3 (sm_89+) or int8 into int32
            if FMT == 1:
                acc += tl.dot(a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True))
            else:
                acc += tl.dot(a, b, out_dtype=tl.int32)
        else:
            acc += tl.dot(_widen(a, FMT), _widen(b, FMT))
    sa = tl.load(as_ptr + m, mask=m < M, other=0.0)
    sb = tl.load(bs_ptr + n, mask=n < N, other=0.0)
    out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def _tiles(M: int, N: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_stages) of an 8-bit or 4-bit matmul: a decode step's few
    rows take the smallest tile tl.dot allows, so the weights, read once, are spread over many
    programs; larger batches take taller tiles."""
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    bn = 64 if M <= 64 or N < 4096 else 128
    return bm, bn, 128, 4


def native_dot(device: torch.device, fmt: int) -> bool:
    """Whether the GPU multiplies the 8-bit codes itself: fp8 e4m3 from compute capability 8.9
    (Ada, Hopper), int8 from 8.0; never under Triton's interpreter (its fp8 casts are wrong)."""
    from kernels.triton import interpreting
    if interpreting() or device.type != "cuda":
        return False
    return _capability(device.index) >= ((8, 9) if fmt == FMT_FP8 else (8, 0))


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    """The device's compute capability, read once (every quantized layer asks, every eager step)."""
    return torch.cuda.get_device_capability(index)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, fmt: int,
              out_dtype: torch.dtype = torch.float32, native: bool | None = None) -> torch.Tensor:
    """a (M, K), b (N, K) 8-bit codes (contiguous), a_scale (M,), b_scale (N,) float32 ->
    (a b^T) * a_scale[:, None] * b_scale[None, :], (M, N) in ``out_dtype``. ``native``: the
    tensor cores' 8-bit MMA (default: where the device has it) or codes widened to float32."""
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M and N:
        bm, bn, bk, stages = _tiles(M, N)
        _scaled_mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            a, b, a_scale, b_scale, out, M, N, K, FMT=fmt,
            NATIVE=native_dot(a.device, fmt) if native is None else native,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_stages=stages)
    return out


def _decode(codes: torch.Tensor, fmt: int) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float() if fmt == FMT_FP8 else codes.float()


def scaled_mm_ref(a, b, a_scale, b_scale, fmt: int) -> torch.Tensor:
    return (_decode(a, fmt).double() @ _decode(b, fmt).double().T * a_scale.double()[:, None]
            * b_scale.double()[None, :]).float()


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor | None,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x (M, K) float, w (N, K) fp8 e4m3 bytes (uint8), w_scale (N,) -> (M, N) in ``out_dtype``;
    the activations quantized per token, or with the static ``input_scale``."""
    x = x.contiguous()
    if input_scale is None:
        q, s = per_token_quant(x, FMT_FP8)
    else:
        s = input_scale.float().reshape(1).expand(x.shape[0]).contiguous()
        q = (x.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return scaled_mm(q, w, s, w_scale, FMT_FP8, out_dtype)


def int8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x (M, K) float, w (N, K) int8, w_scale (N,) -> (M, N) in ``out_dtype``, activations int8
    per token."""
    q, s = per_token_quant(x.contiguous(), FMT_INT8)
    return scaled_mm(q, w, s, w_scale, FMT_INT8, out_dtype)


@triton.jit
def _int4_matmul_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, g_ptr, out_ptr, M, N, K, stride_x,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k[:, None] < K
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        packed = tl.load(qw_ptr + (k[:, None] // 8).to(tl.int64) * N + n[None, :], mask=kmask & nmask, other=0)
        q = (packed >> ((k[:, None] % 8) * 4)) & 0xF
        if GROUP > 0:         # groups in order, BLOCK_K dividing GROUP: one zero and scale per column
            g = k0 // GROUP
            z = tl.load(z_ptr + g * N + n, mask=n < N, other=0)[None, :]
            s = tl.load(s_ptr + g * N + n, mask=n < N, other=0.0)[None, :]
        else:                 # act-order: each input feature's own group
            g = tl.load(g_ptr + k, mask=k < K, other=0)
            z = tl.load(z_ptr + g[:, None].to(tl.int64) * N + n[None, :], mask=kmask & nmask, other=0)
            s = tl.load(s_ptr + g[:, None].to(tl.int64) * N + n[None, :], mask=kmask & nmask, other=0.0)
        w = (q - z.to(tl.int32)).to(tl.float32) * s.to(tl.float32)           # (BLOCK_K, BLOCK_N)
        acc += tl.dot(x.to(x_ptr.dtype.element_ty), w.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)
    tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & nmask)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, group_size: int = 0, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x (M, K) float; qweight (K / 8, N) int32 (value k in bits 4 (k % 8) of word k // 8);
    zeros (G, N) int8; scales (G, N) float16; g_idx (K,) int32 -> x w (M, N) in ``out_dtype``.
    ``group_size`` > 0 says g_idx is k // group_size (no act-order): each tile then reads one
    zero and scale per column instead of one per weight."""
    M, K = x.shape
    N = qweight.shape[1]
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M and N:
        bm, bn, bk, stages = _tiles(M, N)
        group = group_size if group_size >= 16 and group_size & (group_size - 1) == 0 else 0
        if group:
            bk = min(bk, group)
        _int4_matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            x, qweight, zeros, scales, g_idx, out, M, N, K, x.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP=group, DOT_PRECISION=dot_precision(x.dtype), num_stages=stages)
    return out


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q (K, N) values 0..15 -> (K / 8, N) int32, value k in bits 4 (k % 8) of word k // 8."""
    K, N = q.shape
    v = q.to(torch.int64).reshape(K // 8, 8, N)
    word = (v << (4 * torch.arange(8, dtype=torch.int64, device=q.device))[None, :, None]).sum(1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def int4_dequantize_ref(qweight, zeros, scales, g_idx) -> torch.Tensor:
    """(K, N) float32 weights of int4_linear's operands."""
    K = g_idx.numel()
    shifts = 4 * (torch.arange(K, device=qweight.device) % 8)
    q = (qweight.to(torch.int64).repeat_interleave(8, dim=0) >> shifts[:, None]) & 0xF
    g = g_idx.long()
    return (q - zeros.long()[g]).float() * scales.float()[g]


def int4_linear_ref(x, qweight, zeros, scales, g_idx) -> torch.Tensor:
    return (x.double() @ int4_dequantize_ref(qweight, zeros, scales, g_idx).double()).float()
