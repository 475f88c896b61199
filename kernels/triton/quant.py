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

A decode step's few rows on a layer too narrow to give every multiprocessor a tile leave most of
the GPU idle; both matmuls then cut K into slices (split-K, ``split_k``): each program adds up one
slice's products into a workspace, and a second kernel adds the slices in order, applies the
scales and writes the model dtype.
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
def _scaled_mm_kernel(a_ptr, b_ptr, as_ptr, bs_ptr, out_ptr, ws_ptr, M, N, K, K_SPLIT, FMT: tl.constexpr,
                      NATIVE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pm, pn, pk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    if NATIVE and FMT == 0:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum(K, (pk + 1) * K_SPLIT)
    for k0 in range(pk * K_SPLIT, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + m[:, None].to(tl.int64) * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < k_end),
                    other=0)
        b = tl.load(b_ptr + n[None, :].to(tl.int64) * K + k[:, None], mask=(n[None, :] < N) & (k[:, None] < k_end),
                    other=0)
        if NATIVE:            # the tensor cores' own 8-bit MMA: fp8 e4m3 (sm_89+) or int8 into int32
            if FMT == 1:
                acc += tl.dot(a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True))
            else:
                acc += tl.dot(a, b, out_dtype=tl.int32)
        else:
            acc += tl.dot(_widen(a, FMT), _widen(b, FMT))
    mask = (m[:, None] < M) & (n[None, :] < N)
    if SPLIT_K > 1:           # this slice of K's partial sums; _split_k_reduce adds them and scales
        tl.store(ws_ptr + (pk * M + m[:, None]).to(tl.int64) * N + n[None, :], acc, mask=mask)
    else:
        sa = tl.load(as_ptr + m, mask=m < M, other=0.0)
        sb = tl.load(bs_ptr + n, mask=n < N, other=0.0)
        out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
        tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_reduce_kernel(ws_ptr, as_ptr, bs_ptr, out_ptr, M, N, SPLIT_K: tl.constexpr, SCALED: tl.constexpr,
                           BLOCK: tl.constexpr):
    """out[m, n] = sum over the K slices of ws[s, m, n] (x a_scale[m] b_scale[n] when SCALED), in
    out's dtype: the slices added in order, in the workspace's type (int32 sums stay exact)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    acc = tl.load(ws_ptr + i, mask=mask, other=0)
    for s in range(1, SPLIT_K):
        acc += tl.load(ws_ptr + (s * M).to(tl.int64) * N + i, mask=mask, other=0)
    out = acc.to(tl.float32)
    if SCALED:
        out = out * tl.load(as_ptr + i // N, mask=mask, other=0.0) * tl.load(bs_ptr + i % N, mask=mask, other=0.0)
    tl.store(out_ptr + i, out.to(out_ptr.dtype.element_ty), mask=mask)


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


def split_k(M: int, N: int, K: int, device: torch.device, bm: int, bn: int, bk: int) -> int:
    """How many slices of K a matmul's programs share, each adding its partial sums into a
    workspace that a second kernel adds up: a decode step's few rows times a layer narrower than
    the GPU has multiprocessors per tile column make too few programs to keep the device reading
    (4096 outputs in 64-wide tiles: 64 programs for an H200's 132 multiprocessors), so K is cut
    until the programs fill the device once, each slice at least 4 tiles of K long. 1 (no split)
    off CUDA and whenever the tiles alone fill the device."""
    from kernels.triton import interpreting
    if interpreting() or device.type != "cuda":
        return 1
    programs = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    sms = _multiprocessors(device.index)
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(sms, programs), triton.cdiv(K, bk) // 4, 16))


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()) \
        .multi_processor_count


def _slices(out: torch.Tensor, K: int, tiles: tuple[int, int, int, int], splits: int | None,
            ws_dtype: torch.dtype) -> tuple[int, int, torch.Tensor]:
    """(slices, elements of K per slice, the partial sums' workspace (slices, M, N), or ``out``
    itself when K is not cut): whole tiles of K per slice, no slice empty; ``splits`` None:
    ``split_k``'s choice for the device."""
    M, N = out.shape
    bm, bn, bk, _ = tiles
    splits = split_k(M, N, K, out.device, bm, bn, bk) if splits is None else splits
    per = triton.cdiv(triton.cdiv(K, bk), max(1, splits)) * bk
    n = triton.cdiv(K, per)
    return n, per, torch.empty(n, M, N, dtype=ws_dtype, device=out.device) if n > 1 else out


def _reduce(ws: torch.Tensor, out: torch.Tensor, a_scale: torch.Tensor | None, b_scale: torch.Tensor | None) -> None:
    M, N = out.shape
    block = 1024
    _split_k_reduce_kernel[(triton.cdiv(M * N, block),)](
        ws, a_scale if a_scale is not None else ws, b_scale if b_scale is not None else ws, out, M, N,
        SPLIT_K=ws.shape[0], SCALED=a_scale is not None, BLOCK=block)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, fmt: int,
              out_dtype: torch.dtype = torch.float32, native: bool | None = None,
              splits: int | None = None) -> torch.Tensor:
    """a (M, K), b (N, K) 8-bit codes (contiguous), a_scale (M,), b_scale (N,) float32 ->
    (a b^T) * a_scale[:, None] * b_scale[None, :], (M, N) in ``out_dtype``. ``native``: the
    tensor cores' 8-bit MMA (default: where the device has it) or codes widened to float32.
    ``splits``: slices of K (default: ``split_k``'s choice for the device)."""
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M and N:
        bm, bn, bk, stages = tiles = _tiles(M, N)
        native = native_dot(a.device, fmt) if native is None else native
        # int8 codes on the int8 MMA sum exactly in int32; the rest in float32
        n_split, per, ws = _slices(out, K, tiles, splits, torch.int32 if native and fmt == FMT_INT8 else torch.float32)
        _scaled_mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), n_split)](
            a, b, a_scale, b_scale, out, ws, M, N, K, per, FMT=fmt, NATIVE=native, SPLIT_K=n_split,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_stages=stages)
        if n_split > 1:
            _reduce(ws, out, a_scale, b_scale)
    return out


def _decode(codes: torch.Tensor, fmt: int) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float() if fmt == FMT_FP8 else codes.float()


def scaled_mm_ref(a, b, a_scale, b_scale, fmt: int) -> torch.Tensor:
    return (_decode(a, fmt).double() @ _decode(b, fmt).double().T * a_scale.double()[:, None]
            * b_scale.double()[None, :]).float()


def ops():
    """torch.ops.troupe with these kernels registered (kernels/triton/ops.py, imported on first use)."""
    import kernels.triton.ops  # noqa: F401
    return torch.ops.troupe


def quantize_activations(x: torch.Tensor, fmt: int, custom_op: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> per-token 8-bit codes and scales: the Triton kernel (as the custom op
    ``troupe::per_token_quant``), or with ``custom_op`` False (-O0 and -O3) the same arithmetic
    in plain torch ops, which inductor fuses into the RMSNorm before it at -O3 (the norm's row
    is quantized where it is computed, not written out and read again)."""
    if custom_op:
        return ops().per_token_quant(x, fmt)
    return per_token_quant_ref(x, fmt)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor | None,
               out_dtype: torch.dtype = torch.float32, custom_op: bool = True) -> torch.Tensor:
    """x (M, K) float, w (N, K) fp8 e4m3 bytes (uint8), w_scale (N,) -> (M, N) in ``out_dtype``;
    the activations quantized per token (``quantize_activations``), or with the static
    ``input_scale``."""
    x = x.contiguous()
    if input_scale is None:
        q, s = quantize_activations(x, FMT_FP8, custom_op)
    else:
        s = input_scale.float().reshape(1).expand(x.shape[0]).contiguous()
        q = (x.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return ops().scaled_mm(q, w, s, w_scale, FMT_FP8, out_dtype)


def int8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype = torch.float32, custom_op: bool = True) -> torch.Tensor:
    """x (M, K) float, w (N, K) int8, w_scale (N,) -> (M, N) in ``out_dtype``, activations int8
    per token."""
    q, s = quantize_activations(x.contiguous(), FMT_INT8, custom_op)
    return ops().scaled_mm(q, w, s, w_scale, FMT_INT8, out_dtype)


@triton.jit
def _int4_matmul_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, g_ptr, out_ptr, ws_ptr, M, N, K, K_SPLIT, stride_x,
                        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        WORDS_ONCE: tl.constexpr):
    pm, pn, pk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum(K, (pk + 1) * K_SPLIT)
    for k0 in range(pk * K_SPLIT, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k[:, None] < k_end
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=(m[:, None] < M) & (k[None, :] < k_end), other=0.0)
        if WORDS_ONCE:        # each word loaded once, its 8 values shifted out: (BLOCK_K / 8, 8, BLOCK_N)
            kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words = tl.load(qw_ptr + kw[:, None].to(tl.int64) * N + n[None, :],
                            mask=(kw[:, None] * 8 < k_end) & nmask, other=0)
            q = tl.reshape((words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        else:                 # each value's word (8 loads of it, from the cache)
            packed = tl.load(qw_ptr + (k[:, None] // 8).to(tl.int64) * N + n[None, :], mask=kmask & nmask, other=0)
            q = (packed >> ((k[:, None] % 8) * 4)) & 0xF
        if GROUP > 0:         # groups in order, BLOCK_K dividing GROUP: one zero and scale per column,
            g = k0 // GROUP   # so the tile's product is scaled after the dot (BLOCK_M x BLOCK_N products)
            z = tl.load(z_ptr + g * N + n, mask=n < N, other=0)[None, :]
            s = tl.load(s_ptr + g * N + n, mask=n < N, other=0.0)
            w = (q - z.to(tl.int32)).to(x_ptr.dtype.element_ty)                  # -15..15: exact
            acc += tl.dot(x.to(x_ptr.dtype.element_ty), w, input_precision=DOT_PRECISION) * s.to(tl.float32)[None, :]
        else:                 # act-order: each input feature's own group
            g = tl.load(g_ptr + k, mask=k < k_end, other=0)
            z = tl.load(z_ptr + g[:, None].to(tl.int64) * N + n[None, :], mask=kmask & nmask, other=0)
            s = tl.load(s_ptr + g[:, None].to(tl.int64) * N + n[None, :], mask=kmask & nmask, other=0.0)
            w = (q - z.to(tl.int32)).to(tl.float32) * s.to(tl.float32)           # (BLOCK_K, BLOCK_N)
            acc += tl.dot(x.to(x_ptr.dtype.element_ty), w.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)
    if SPLIT_K > 1:
        tl.store(ws_ptr + (pk * M + m[:, None]).to(tl.int64) * N + n[None, :], acc, mask=(m[:, None] < M) & nmask)
    else:
        tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(m[:, None] < M) & nmask)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, group_size: int = 0, out_dtype: torch.dtype = torch.float32,
                splits: int | None = None, words_once: bool = False) -> torch.Tensor:
    """x (M, K) float; qweight (K / 8, N) int32 (value k in bits 4 (k % 8) of word k // 8);
    zeros (G, N) int8; scales (G, N) float16; g_idx (K,) int32 -> x w (M, N) in ``out_dtype``.
    ``group_size`` > 0 says g_idx is k // group_size (no act-order): each tile then reads one
    zero and scale per column instead of one per weight, and scales the tile's product after the
    dot. ``splits``: slices of K (as scaled_mm's). ``words_once``: each packed word loaded once
    and its 8 values shifted out in registers, instead of loaded once per value (the cache
    serving the repeats)."""
    M, K = x.shape
    N = qweight.shape[1]
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M and N:
        bm, bn, bk, stages = _tiles(M, N)
        group = group_size if group_size >= 16 and group_size & (group_size - 1) == 0 else 0
        if group:
            bk = min(bk, group)
        n_split, per, ws = _slices(out, K, (bm, bn, bk, stages), splits, torch.float32)
        _int4_matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), n_split)](
            x, qweight, zeros, scales, g_idx, out, ws, M, N, K, per, x.stride(0), SPLIT_K=n_split, BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=bk, GROUP=group, DOT_PRECISION=dot_precision(x.dtype), WORDS_ONCE=words_once,
            num_stages=stages)
        if n_split > 1:
            _reduce(ws, out, None, None)
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
